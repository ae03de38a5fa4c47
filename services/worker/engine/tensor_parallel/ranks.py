"""The tensor-parallel ranks 1..n-1 of one worker: rank 0 spawns them, each loads the model from the folder, keeps
its shard and runs the steps rank 0 sends; rank 0 watches them, and a rank lost ends them all and the worker.

Start-up: each rank loads the model and reports it (or its failure, which fails the worker's start with one
line naming the rank); then all join one process group (gloo on the CPU, NCCL on CUDA) through a TCPStore rank
0 serves on the loopback; each shards, agrees on the KV block count and (CUDA) captures its decode graphs
together with the others, and reports ready, each stage within ``tensor_parallel_start_timeout_s``. A rank
that exits later, or a collective that fails or passes
``tensor_parallel_timeout_s``, is a lost rank: every rank is killed and ``on_lost`` runs (by default the worker
exits a second later, once its failed streams ended: its supervisor restarts it, its routers migrate what ran
there). Ranks die with rank 0 (PDEATHSIG, and a check of their parent while they wait for a step).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from services.worker.engine.config import EngineConfig
from services.worker.engine.tensor_parallel.channel import StepChannel, parent_alive
from services.worker.engine.tensor_parallel.collectives import Collectives
from services.worker.engine.tensor_parallel.runner import STOP

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
"""Where the ranks meet: they are one worker's processes on one node."""
_PR_SET_PDEATHSIG = 1
STORE_MIN_TIMEOUT_S = 60.0


class RankStartError(RuntimeError):
    """A rank that could not start; the message names it and its cause."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to start."""

    rank: int
    size: int
    model_dir: str
    config: EngineConfig
    store_port: int
    channel_path: str
    parent: int
    threads: int


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for ``cpu``; the rank-th GPU from ``device``'s index for CUDA."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class RankGroup:
    """Rank 0's handle on ranks 1..n-1: their processes, the step channel, the process group.

    Invariant: after ``start`` every rank is in its step loop or has been reported lost; ``lost`` runs once
    and kills every rank; ``stop`` ends them all and is safe to call again.
    """

    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.size = size = config.tensor_parallel_size
        self.timeout_s = config.tensor_parallel_timeout_s
        self.start_timeout_s = config.tensor_parallel_start_timeout_s
        self.on_lost: Callable[[str], None] = exit_soon
        self.lost_cause: str | None = None  # set once a rank is lost: nothing more runs here
        self._stopping = threading.Event()
        self._lost_once = threading.Lock()
        context = multiprocessing.get_context("spawn")
        self._events = [context.Event() for _ in range(size - 1)]
        self.channel = StepChannel.create(self._events)
        self.processes: list[Any] = []
        self._conns: list[Connection] = []
        try:
            self._spawn(context, model_dir, config)
            atexit.register(self.stop)
            self._wait_for("loaded")
        except BaseException:
            self.stop()  # whatever started ends (safe after _wait_for's own stop)
            raise
        finally:
            self.channel.unlink()  # every rank has opened it (or is gone)
        self.group = Collectives.create(self._store, 0, size, rank_device(config.device, 0), self.timeout_s)

    def _spawn(self, context: Any, model_dir: str, config: EngineConfig) -> None:
        """The TCPStore the ranks meet at, and ranks 1..n-1 started."""
        size = self.size
        self._store = dist.TCPStore(STORE_HOST, 0, size, is_master=True, timeout=_td(_store_timeout(config)),
                                    wait_for_workers=False)  # fmt: skip
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            spec = RankSpec(rank, size, model_dir, config, self._store.port, self.channel.path, os.getpid(),
                            torch.get_num_threads())  # fmt: skip
            process = context.Process(target=rank_main, args=(spec, theirs, self._events), name=f"epd-tp-rank{rank}")
            process.start()
            theirs.close()
            self.processes.append(process)
            self._conns.append(ours)

    def ready(self) -> None:
        """Wait until every rank has built its runner, then watch them."""
        self._wait_for("ready")
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def _wait_for(self, stage: str) -> None:
        """Each rank's report of ``stage``; RankStartError naming the first rank that failed or exited instead."""
        for rank, (conn, process) in enumerate(zip(self._conns, self.processes, strict=True), start=1):
            while True:
                ready = wait([conn, process.sentinel], timeout=self.start_timeout_s)
                if not ready:
                    self.stop()
                    raise RankStartError(
                        f"tensor-parallel rank {rank} did not report {stage} in {self.start_timeout_s}s"
                    )
                report = _recv(conn) if conn in ready else None
                if report is None:
                    process.join(1)
                    self.stop()
                    raise RankStartError(f"tensor-parallel rank {rank} exited (code {process.exitcode}) at start-up")
                kind, detail = report
                if kind == "failed":
                    self.stop()
                    raise RankStartError(f"tensor-parallel rank {rank} failed to start: {detail}")
                if kind == stage:
                    break

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        while not self._stopping.is_set():
            for sentinel in wait(list(sentinels), timeout=0.5):
                rank, process = sentinels[sentinel]
                if not self._stopping.is_set():
                    process.join(0.1)
                    self.lost(f"rank {rank} exited (code {process.exitcode})")
                return

    def lost(self, cause: str) -> None:
        """A rank is gone or a collective failed: kill every rank, then ``on_lost``; once."""
        if self._stopping.is_set() or not self._lost_once.acquire(blocking=False):
            return
        log.critical("tensor parallelism lost: %s; ending all %d ranks", cause, self.size)
        self.lost_cause = cause
        self._stopping.set()
        self._kill()
        self.on_lost(cause)

    def stop(self) -> None:
        """End every rank: the stop message, a few seconds to exit, then SIGKILL."""
        if self._stopping.is_set():
            self._kill()
            return
        self._stopping.set()
        with contextlib.suppress(ValueError, OSError):
            self.channel.send(STOP)
        for process in self.processes:
            process.join(5)
        self._kill()

    def _kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5)


def exit_soon(cause: str) -> None:
    """The worker cannot serve without its ranks: exit (code 1) once the failed streams had a second to end."""
    threading.Timer(1.0, os._exit, args=(1,)).start()


def rank_main(spec: RankSpec, conn: Connection, events: list[Any]) -> None:
    """A rank process: load, report, join the group, shard, build the runner, report, serve steps."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the check of its parent still ends it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    torch.set_num_threads(spec.threads)
    try:
        from services.common.model_info import load_model_info
        from services.worker.engine.tensor_parallel.layers import drop_all_but_the_language_model, shard_language_model
        from services.worker.engine.tensor_parallel.plan import ShardPlan
        from services.worker.engine.tensor_parallel.runner import ShardRunner

        config = spec.config
        channel = StepChannel(spec.channel_path, events, spec.rank - 1)
        adapter = load_model_info(spec.model_dir).adapter
        model = adapter.load_model("cpu", config.torch_dtype)
        plan = ShardPlan.of_config(model.config, spec.size)
        drop_all_but_the_language_model(model)  # the vision tower runs on rank 0 only
        conn.send(("loaded", None))
        store = dist.TCPStore(STORE_HOST, spec.store_port, spec.size, is_master=False,
                              timeout=_td(_store_timeout(config)))  # fmt: skip
        device = rank_device(config.device, spec.rank)
        group = Collectives.create(store, spec.rank, spec.size, device, config.tensor_parallel_timeout_s)
        shard_language_model(model, plan, spec.rank, group)
        model.to(device)
        runner = ShardRunner(adapter, model, dataclasses.replace(config, device=str(device)), group)  # its own GPU
        conn.send(("ready", None))
    except BaseException as exc:
        log.exception("rank %d failed to start", spec.rank)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    runner.serve(channel, parent_alive(spec.parent))


def _recv(conn: Connection) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _store_timeout(config: EngineConfig) -> float:
    """The start-up TCPStore's bound on each of its calls (connecting included): the start timeout, but never so
    short that a loaded machine cannot connect to its own loopback."""
    return max(config.tensor_parallel_start_timeout_s, STORE_MIN_TIMEOUT_S)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))
