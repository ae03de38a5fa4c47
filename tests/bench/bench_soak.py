"""Benchmark: soak: mixed traffic for a long time with a fault every two minutes.

A cluster on free ports with a private Redis: 2 routers (the client balances over both and retries
UNAVAILABLE before any answer, as a client behind router replicas does), 2 encoders, 2 workers, every
service supervised as `epd up` does (a service that exits is started again). `--clients` threads send
requests back to back for `--duration-s`: greedy image requests over a bounded set of `--images` images
(so the caches fill during the warm-up and then stay, as in steady traffic), seeded sampled text with a stop
string, plain greedy text; eos ignored, n = 1 (a request of n > 1 cannot move once its tokens streamed).
Every `--kill-every-s` one fault, in turn: kill -9 a worker, kill -9 an encoder, SIGTERM a router, SIGTERM
a worker, SIGTERM an encoder (routers are never killed with -9: their client streams cannot move).

Measured: requests by outcome (the failures with their status), migrations, and every `--sample-every-s`
each service process's resident memory and open file descriptors (the main process of each; a restarted
service starts a new series). Growth of a series = its last sample over its first sample taken at least
`--warm-up-s` after the process started (series shorter than that are not judged). At the end: every
worker's free blocks == total, nothing reserved, running or pinned. Last line, JSON: the figures and
`ok` (0 failed, every judged series within `--flat` (10%), workers settled). Descriptors may also grow by
`--fd-slack` (default 0): each Redis or gRPC connection is one, and a service's Redis pools grow with the
concurrency it meets (up to its thread pool's size, then flat), so a short run judges them with some slack.
Run: `epd bench soak [--duration-s 1200] [--kill-every-s 120]` (20 minutes by default).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.reliability_support import Load, image_request, settled_workers, text_request

FAULTS = [
    ("worker", signal.SIGKILL),
    ("encoder", signal.SIGKILL),
    ("router", signal.SIGTERM),
    ("worker", signal.SIGTERM),
    ("encoder", signal.SIGTERM),
]


@dataclass
class Series:
    """One process incarnation's samples: (seconds since it started, rss bytes, open fds)."""

    name: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)

    def growth(self, warm_up_s: float) -> dict[str, float] | None:
        after = [s for s in self.samples if s[0] >= warm_up_s]
        if len(after) < 2:
            return None
        (_, rss0, fds0), (_, rss1, fds1) = after[0], after[-1]
        return {
            "rss_mb": rss1 / 2**20,
            "rss_growth": rss1 / rss0 - 1,
            "fds_first": fds0,
            "fds": fds1,
            "fds_max": max(s[2] for s in after),
            "fds_growth": fds1 / fds0 - 1,
        }


def _make(images: int):
    def make(i: int):
        kind = i % 3
        if kind == 0:
            return image_request(i % images, 24)
        request = text_request(i, 32)
        if kind == 1:
            request.sampling.temperature, request.sampling.top_p, request.sampling.seed = 0.8, 0.9, i
            request.sampling.stop.append("zq")
        return request

    return make


def _sample(processes: list[Any], series: dict[int, Series]) -> None:
    for process in processes:
        pid = process.popen.pid
        try:
            ps = psutil.Process(pid)
            point = (time.time() - ps.create_time(), ps.memory_info().rss, ps.num_fds())
        except psutil.Error:
            continue
        series.setdefault(pid, Series(f"{process.role} {process.address} pid {pid}")).samples.append(point)


def run_soak(
    duration_s: float,
    kill_every_s: float,
    clients: int,
    images: int,
    warm_up_s: float,
    sample_every_s: float,
    flat: float,
    fd_slack: int = 0,
) -> dict[str, Any]:
    """Run the soak and return its figures (printed by `main`)."""
    from services.launch import local
    from services.launch.health import wait_healthy
    from services.launch.supervisor import Supervisor
    from services.models.tiny_model import make_tiny_model
    from tests.conftest import TINY_TEST_MAX_PIXELS
    from tests.redis_server import RedisServer

    redis = RedisServer(local.free_port())
    redis.start()
    events: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", "qwen2-vl", max_pixels=TINY_TEST_MAX_PIXELS)
        spec = local.ClusterSpec(
            model, encoders=2, workers=2, redis_url=redis.url, free_ports=True, log_dir=Path(tmp) / "logs"
        )
        cluster = local.start_cluster(spec)
        second = local.spawn(
            "router",
            local.free_port(),
            local.free_port(),
            {**cluster.router.env, "EPD_HTTP_PORT": "0"},
            Path(tmp) / "logs",
        )
        wait_healthy(second.address, 120, lambda: second.popen.poll() is None)
        processes = [cluster.router, second, *cluster.encoders, *cluster.workers]
        series: dict[int, Series] = {}
        faults = 0
        start = time.monotonic()
        try:
            with (
                Supervisor(processes, report=events.append),
                Load([cluster.router.address, second.address], _make(images), clients=clients) as load,
            ):
                next_fault, next_sample = start + kill_every_s, start
                while (now := time.monotonic()) < start + duration_s:
                    if now >= next_sample:
                        _sample(processes, series)
                        next_sample += sample_every_s
                    if now >= next_fault:
                        role, sig = FAULTS[faults % len(FAULTS)]
                        victims = [p for p in processes if p.role == role]
                        victim = victims[(faults // len(FAULTS)) % len(victims)]
                        events.append(f"{now - start:7.1f}s fault: {sig.name} {role} {victim.address}")
                        os.kill(victim.popen.pid, sig)
                        faults += 1
                        next_fault += kill_every_s
                    time.sleep(0.2)
            for process in processes:  # restarted ones serve again before the leak check
                wait_healthy(process.address, 180, lambda: True)
            settled, settled_error = True, ""
            try:
                final_states = settled_workers(redis.url, 2)
            except AssertionError as exc:
                settled, settled_error, final_states = False, str(exc), []
        finally:
            second.popen.terminate()
            second.popen.wait(30)
            cluster.stop()
            redis.stop()
    outcomes = load.outcomes
    failed = [o for o in outcomes if not o.ok]
    judged = {s.name: g for s in series.values() if (g := s.growth(warm_up_s)) is not None}
    worst_rss = max((g["rss_growth"] for g in judged.values()), default=0.0)
    worst_fds = max((g["fds_growth"] for g in judged.values()), default=0.0)
    fds_flat = all(g["fds"] <= g["fds_first"] * (1 + flat) + fd_slack for g in judged.values())
    return {
        "duration_s": duration_s,
        "faults": faults,
        "requests": len(outcomes),
        "failed": len(failed),
        "failed_by_status": dict(Counter(o.code.name if o.code else "no final" for o in failed)),
        "failed_examples": [o.details for o in failed[:5]],
        "migrations": sum(o.migrations for o in outcomes),
        "requests_migrated": sum(1 for o in outcomes if o.migrations),
        "restarts": sum(1 for e in events if "restarted:" in e),
        "worst_rss_growth": worst_rss,
        "worst_fds_growth": worst_fds,
        "series": judged,
        "workers_settled": settled,
        "settled_error": settled_error,
        "final_worker_states": [
            {k: s[k] for k in ("total_blocks", "free_blocks", "reserved_blocks", "pinned_embeddings") if k in s}
            for s in final_states
        ],
        "events": events,
        "fds_flat": fds_flat,
        "ok": not failed and settled and worst_rss <= flat and fds_flat,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="epd bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=1200.0, help="how long the traffic runs")
    parser.add_argument("--kill-every-s", type=float, default=120.0, help="seconds between faults")
    parser.add_argument("--clients", type=int, default=6, help="client threads sending back to back")
    parser.add_argument("--images", type=int, default=48, help="distinct images the image requests cycle over")
    parser.add_argument("--warm-up-s", type=float, default=120.0, help="a process's age before it is judged")
    parser.add_argument("--sample-every-s", type=float, default=10.0, help="memory and descriptor sampling period")
    parser.add_argument("--flat", type=float, default=0.10, help="largest growth allowed after warm-up")
    parser.add_argument("--fd-slack", type=int, default=0, help="descriptors a series may add beyond --flat")
    args = parser.parse_args(argv)
    figures = run_soak(
        args.duration_s,
        args.kill_every_s,
        args.clients,
        args.images,
        args.warm_up_s,
        args.sample_every_s,
        args.flat,
        args.fd_slack,
    )
    for event in figures["events"]:
        print(event.strip())
    for name, growth in sorted(figures["series"].items()):
        print(
            f"{name:40s} rss {growth['rss_mb']:7.1f} MiB ({100 * growth['rss_growth']:+5.1f}%)  "
            f"fds {growth['fds_first']:3d} -> {growth['fds']:3d} (max {growth['fds_max']:3d}, "
            f"{100 * growth['fds_growth']:+5.1f}%)"
        )
    print(
        f"{figures['requests']} requests, {figures['failed']} failed {figures['failed_by_status']}, "
        f"{figures['migrations']} migrations ({figures['requests_migrated']} requests), {figures['faults']} faults, "
        f"{figures['restarts']} restarts; workers settled: {figures['workers_settled']}"
    )
    print(json.dumps({k: v for k, v in figures.items() if k not in ("events", "series")}))
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
