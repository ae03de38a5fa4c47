"""`epd bench burst`'s clusters: a started cluster with its stream channels and image sender (`BenchCluster`), one
episode on it (streams, then the images at once), and the pinning of each pool to its own cores.

Invariants: a cluster's episodes each use a salt of their own (their prompts miss the prefix cache) after one
warm-up burst that put the images' embeddings in the caches; a pinned cluster's decoding workers run alone on the
first core, every other service and this process on the rest, set again before each episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from services.client import user_request
from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import generation_pb2_grpc
from tests.bench.burst_clients import ImageSender, Stream, consume
from tests.bench.burst_figures import Episode, RunResult, Settings
from tests.bench.workload import WORDS


def _prompt(i: int) -> str:
    return f"stream {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(16))


async def _episode(stubs: list, sender: ImageSender, settings: Settings, salt: str) -> Episode:
    """Streams decode ``quiet_tokens`` tokens, then every image arrives at once; returns when all ended."""
    streams = [Stream() for _ in range(settings.streams)]
    ready = [asyncio.Event() for _ in streams]
    tasks = []
    for i, stream in enumerate(streams):
        request = user_request(_prompt(i), max_tokens=settings.stream_tokens, cache_salt=salt)
        request.sampling.ignore_eos = True
        tasks.append(asyncio.create_task(consume(stubs[i], request, stream, ready[i], settings.quiet_tokens)))
    await asyncio.gather(*(e.wait() for e in ready))
    burst_at = time.perf_counter()
    bursts, _ = await asyncio.gather(sender.burst(salt, settings.image_tokens), asyncio.gather(*tasks))
    return Episode(streams, bursts, burst_at)


class BenchCluster:
    """A started cluster (a target set or not), a channel per stream, an image sender, the images' embeddings
    cached."""

    def __init__(self, cluster: Any, settings: Settings, images: list[bytes]) -> None:
        self.cluster = cluster
        self.settings = settings
        options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        self.channels = [grpc.aio.insecure_channel(cluster.address, options=options) for _ in range(settings.streams)]
        self.stubs = [generation_pb2_grpc.GenerationStub(c) for c in self.channels]
        self.sender = ImageSender(cluster.address, images)
        self.result = RunResult([])

    @classmethod
    async def open(
        cls,
        model: Path,
        redis_url: str,
        settings: Settings,
        images: list[bytes],
        target_ms: float,
        env: dict[str, str],
        prefill_workers: int = 0,
        pd_min_prefill_tokens: int = 256,
        pinned: bool = False,
    ) -> BenchCluster:
        from services.launch.local import ClusterSpec, StartCancelled, start_cluster

        env = {**env, "EPD_ITL_TARGET_MS": str(target_ms), "EPD_HTTP_PORT": "0"}
        spec = ClusterSpec(
            model,
            redis_url=redis_url,
            free_ports=True,
            env=env,
            prefill_workers=prefill_workers,
            pd_min_prefill_tokens=pd_min_prefill_tokens,
        )
        cancelled = threading.Event()
        starting = asyncio.get_running_loop().run_in_executor(None, partial(start_cluster, spec, cancelled=cancelled))
        try:
            cluster = await asyncio.shield(starting)
        except asyncio.CancelledError:  # interrupted while it starts: it stops waiting and stops what it started
            cancelled.set()
            with contextlib.suppress(StartCancelled):
                (await starting).stop()  # it had started all the same
            raise
        opened = cls(cluster, settings, images)
        opened.pinned = pinned
        try:
            opened.pin()
            if pinned:
                print(f"pinned ({'P/D' if prefill_workers else 'co-located'}): {opened.affinities()}", flush=True)
            await asyncio.gather(opened.sender.ready(), *(c.channel_ready() for c in opened.channels))
            # the embeddings into the caches; each episode's own salt keeps its prompts out of the KV cache
            await opened.sender.burst("warm", 1)
        except BaseException:
            await opened.close()
            raise
        return opened

    pinned = False

    def pin(self) -> None:
        """With `pinned`: the workers that decode alone on the first core, everything else on the others."""
        if self.pinned:
            others = [self.cluster.router, *self.cluster.encoders, *self.cluster.prefill_workers]
            pin_pools([p.popen.pid for p in self.cluster.workers], [os.getpid(), *(p.popen.pid for p in others)])

    def affinities(self) -> str:
        """Each service's cores as its threads have them now (the union over its threads)."""
        import psutil

        parts = []
        for process in self.cluster.processes:
            role = process.env.get("EPD_WORKER_ROLE", process.role) if process.role == "worker" else process.role
            cores = {c for t in psutil.Process(process.popen.pid).threads() for c in os.sched_getaffinity(t.id)}
            parts.append(f"{role} {sorted(cores)}")
        return ", ".join(parts) + f", this process {sorted(os.sched_getaffinity(0))}"

    def remote_prefills(self) -> float:
        """Requests this cluster's router sent to a prefill worker that came back acknowledged."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.cluster.router.metrics_port}/metrics", timeout=10)
        lines = text.read().decode().splitlines()
        return sum(
            float(x.rsplit(" ", 1)[1])
            for x in lines
            if x.startswith("epd_remote_prefills_total{") and 'outcome="sent"' in x
        )

    async def episode(self, salt: str) -> None:
        self.pin()  # threads started since (torch's, gRPC's) inherit from pinned ones; set again anyway
        self.result.episodes.append(await _episode(self.stubs, self.sender, self.settings, salt))
        self.result.load_average = max(self.result.load_average, os.getloadavg()[0])

    async def close(self) -> None:
        """The workers' step metrics read, the clients closed, the cluster stopped: that last whatever happened
        before it (an interrupted bench leaves no service running)."""
        try:
            self.result.worker_metrics = _scrape_step_metrics(self.cluster.workers[0].metrics_port)
            if self.cluster.prefill_workers:
                self.result.remote_prefills = self.remote_prefills()
            await self.sender.close()
            await asyncio.gather(*(c.close() for c in self.channels))
        finally:
            self.cluster.stop()  # on this thread: an await here could be cancelled again


def pin_pools(alone: list[int], others: list[int]) -> None:
    """Every thread of the processes `alone` (with their children) on the first core, every thread of `others` on
    the rest: `os.sched_setaffinity` acts on one thread, so each is set. This process is among `others`: of its
    children only those that are no epd service (its image sender, Redis) go with it, the services being pinned
    by their own cluster's call. Nothing on a one-core box."""
    import psutil

    cores = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    if len(cores) < 2:
        return
    for pids, where in ((others, set(cores[1:])), (alone, {cores[0]})):
        for pid in pids:
            try:
                process = psutil.Process(pid)
                tree = [process, *process.children(recursive=pid != os.getpid())]
                if pid == os.getpid():
                    tree = [p for p in tree if "services.cli" not in " ".join(p.cmdline())]
                for each in tree:
                    for thread in each.threads():
                        os.sched_setaffinity(thread.id, where)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue  # a thread or process that ended meanwhile


def _scrape_step_metrics(port: int) -> str:
    """The worker's step-cost lines from its Prometheus endpoint (coefficients, chosen budgets)."""
    if port <= 0:
        return ""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = re.compile(r"^epd_step_(cost_coefficient|prefill_budget_tokens_(count|sum)|time_ratio_(count|sum))")
    return "\n".join(line for line in text.splitlines() if wanted.match(line))


def metric(text: str, name: str) -> float:
    """The value of an unlabelled (but for OpenTelemetry's scope) sample in a Prometheus text, 0 when absent."""
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, flags=re.MULTILINE)
    return float(found.group(1)) if found else 0.0
