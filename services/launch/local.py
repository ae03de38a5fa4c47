"""`epd up`: the whole cluster as subprocesses on 127.0.0.1.

Starts Redis when none answers (and `redis-server` exists), then encoders, workers, prefill workers (a prefill
pool: `ClusterSpec.prefill_workers`; the workers then decode, EPD_WORKER_ROLE) and the
router, each as `epd serve <role>` with EPD_* settings on the ports `plan_ports` decides; waits
until every gRPC health check says SERVING, reporting each service as it does. Invariant:
`LocalCluster.stop()` terminates every process it started (SIGTERM, then SIGKILL after a grace
period), Redis included when it started it; so does a failed or interrupted `start_cluster`.
Each service is a fresh `python -m services.cli serve <role>` unless this process chose
`set_start_method("forkserver")`: then it is forked from a process that already imported what a service
imports (forkserver.py), when its settings allow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.common.tls import client_from_env
from services.launch import forkserver
from services.launch.health import check
from services.launch.local_redis import ensure_redis
from services.launch.ports import free_port

ROUTER_PORT, ENCODER_PORT, WORKER_PORT, METRICS_PORT, HTTP_PORT = 50051, 50061, 50071, 9400, 8000

StartMethod = Literal["exec", "forkserver"]
_start_method: StartMethod = "exec"
_fork_env: dict[str, str] = {}  # this process's environment when "forkserver" was chosen


def set_start_method(method: StartMethod) -> None:
    """How `spawn` and `respawn` start services in this process from now on: "exec" (the default, `epd up`'s)
    or "forkserver" (forkserver.py: about 3 CPU-seconds of imports fewer per service). A forked service's
    environment is this process's as it is now plus its own settings, whatever this process (or a library
    in it: Ray, torch) sets later; one whose settings name a variable other than `EPD_*`/`OTEL_*` is exec'd."""
    global _start_method, _fork_env
    if method not in ("exec", "forkserver"):
        raise ValueError(f"start method must be 'exec' or 'forkserver', got {method!r}")
    _start_method, _fork_env = method, dict(os.environ)


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    encoders: int = 1  # 0: no encoder process; each worker runs the vision tower itself (co-located)
    workers: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"
    free_ports: bool = False  # tests: pick free ports instead of the ones below
    env: dict[str, str] = field(default_factory=dict)  # extra EPD_* settings for every service
    log_dir: Path | None = None
    router_port: int = ROUTER_PORT
    http_port: int = HTTP_PORT  # 0: the router serves no HTTP; EPD_HTTP_PORT in `env` wins
    encoder_port: int = ENCODER_PORT  # encoders listen on this port and the next ones
    worker_port: int = WORKER_PORT  # workers likewise
    metrics_port: int = METRICS_PORT  # encoders, workers, prefill workers, then the router, one port each; 0: none
    prefill_workers: int = 0  # a prefill pool (EPD_WORKER_ROLE=prefill); the workers then take the decode role
    pd_min_prefill_tokens: int = 128  # with a prefill pool: the router's EPD_PD_MIN_PREFILL_TOKENS (`env` wins)


@dataclass(frozen=True)
class PortPlan:
    """Every port a local cluster listens on, decided before anything starts (0: that endpoint is off)."""

    router: int
    http: int
    encoders: tuple[int, ...]
    workers: tuple[int, ...]
    metrics: tuple[int, ...]  # one per service: encoders, then workers, then prefill workers, then the router
    prefill: tuple[int, ...] = ()  # prefill workers' gRPC ports (after the workers')

    def listening(self) -> list[tuple[str, int]]:
        """`(what, port)` for each port a service will bind, `what` one of router, http, encoder, worker,
        metrics."""
        rows = [("router", self.router), ("http", self.http)]
        rows += [("encoder", p) for p in self.encoders] + [("worker", p) for p in (*self.workers, *self.prefill)]
        rows += [("metrics", p) for p in self.metrics]
        return [(what, port) for what, port in rows if port > 0]


def plan_ports(spec: ClusterSpec) -> PortPlan:
    """The spec's ports (consecutive from each base), or free ones when `spec.free_ports`."""

    def port(base: int) -> int:
        return free_port() if spec.free_ports and base else base

    services = spec.encoders + spec.workers + spec.prefill_workers + 1
    metrics_base = spec.metrics_port
    http = int(spec.env["EPD_HTTP_PORT"]) if "EPD_HTTP_PORT" in spec.env else port(spec.http_port)
    return PortPlan(
        router=port(spec.router_port),
        http=http,
        encoders=tuple(port(spec.encoder_port + i) for i in range(spec.encoders)),
        workers=tuple(port(spec.worker_port + i) for i in range(spec.workers)),
        metrics=tuple(port(metrics_base + i) if metrics_base else 0 for i in range(services)),
        prefill=tuple(port(spec.worker_port + spec.workers + i) for i in range(spec.prefill_workers)),
    )


@dataclass
class Process:
    """One service process; `popen` is replaced in place when it is started again (`respawn`)."""

    role: str
    address: str
    metrics_port: int
    popen: subprocess.Popen | forkserver.ForkedProcess
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # the EPD_* settings it was started with

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class LocalCluster:
    router: Process
    encoders: list[Process]
    workers: list[Process]
    redis_url: str
    redis_process: subprocess.Popen | None = None
    http_port: int = 0  # the router's OpenAI-compatible HTTP port (0: off)
    prefill_workers: list[Process] = field(default_factory=list)  # EPD_WORKER_ROLE=prefill (`workers`: decode)

    @property
    def http_url(self) -> str:
        """Base URL of the router's HTTP API (``http://127.0.0.1:<port>``)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def processes(self) -> list[Process]:
        return [self.router, *self.encoders, *self.workers, *self.prefill_workers]

    @property
    def address(self) -> str:
        return self.router.address

    def stop(self, grace_s: float = 5.0) -> None:
        popens = [p.popen for p in reversed(self.processes)]
        if self.redis_process is not None:
            popens.append(self.redis_process)
        _stop_popens(popens, grace_s)


def spawn(role: str, port: int, metrics_port: int, env: dict[str, str], log_dir: Path) -> Process:
    log_path = log_dir / f"{role}-{port}.log"
    return Process(
        role, f"127.0.0.1:{port}", metrics_port, _popen(role, port, metrics_port, env, log_path), log_path, env
    )


def respawn(process: Process) -> None:
    """Start `process`'s service again with the same role, ports and settings (its log is appended to)."""
    port = int(process.address.rsplit(":", 1)[1])
    process.popen = _popen(process.role, port, process.metrics_port, process.env, process.log_path)


def _popen(
    role: str, port: int, metrics_port: int, env: dict[str, str], log_path: Path
) -> subprocess.Popen | forkserver.ForkedProcess:
    own = {
        **env,
        "EPD_PORT": str(port),
        "EPD_METRICS_PORT": str(metrics_port),
        "EPD_HOST": "127.0.0.1",
        "EPD_ADVERTISE_ADDR": f"127.0.0.1:{port}",
        "EPD_LAUNCHER_PID": str(os.getpid()),  # gone (even by SIGKILL): the service drains and stops
    }
    if _start_method == "forkserver":
        forked = forkserver.shared(_fork_env).spawn(["serve", role], {**_fork_env, **own}, log_path)
        if forked is not None:
            return forked
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", role],
            env={**os.environ, **own},
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


class ClusterStartError(RuntimeError):
    """A service died or was not healthy in time during start-up; everything started was stopped."""

    def __init__(self, process: Process, reason: str, tails: str) -> None:
        super().__init__(f"cluster did not become healthy: {process.role} at {process.address} {reason}\n{tails}")
        self.process = process
        self.reason = reason


class StartCancelled(Exception):
    """`start_cluster` stopped waiting because its caller set `cancelled`; everything started was stopped."""


class _NotReady(Exception):
    def __init__(self, process: Process, reason: str) -> None:
        super().__init__(reason)
        self.process = process
        self.reason = reason


def start_cluster(
    spec: ClusterSpec,
    timeout_s: float = 180.0,
    on_ready: Callable[[Process], None] | None = None,
    cancelled: threading.Event | None = None,
) -> LocalCluster:
    """Start everything and wait for health, calling `on_ready` for each service as it becomes healthy.

    On failure (a service exits, or is not healthy within `timeout_s`) stop what started and raise
    ClusterStartError with every log's tail; on any other exception (Ctrl-C included) stop it and re-raise. A caller
    that runs this on a thread of its own, where Ctrl-C cannot reach it, sets `cancelled` instead: the wait ends
    within a poll (StartCancelled), what started is stopped.
    """
    redis_process = ensure_redis(spec.redis_url)
    spawned: list[Process] = []
    try:
        cluster = _spawn_cluster(spec, plan_ports(spec), redis_process, spawned)
    except BaseException:  # Ctrl-C between two spawns included: nothing started may outlive us
        _stop_popens([p.popen for p in reversed(spawned)] + ([redis_process] if redis_process else []), 5.0)
        raise
    try:
        _wait_ready(cluster.processes, timeout_s, on_ready or (lambda _process: None), cancelled)
    except _NotReady as exc:
        tails = "\n".join(f"--- {p.role} {p.address} ---\n{p.log_tail()}" for p in cluster.processes)
        cluster.stop()
        raise ClusterStartError(exc.process, exc.reason, tails) from None
    except BaseException:
        cluster.stop()
        raise
    return cluster


def torch_threads(spec: ClusterSpec, cores: int) -> int:
    """Intra-op threads of each service: the box's cores split over the services that compute, not all of them
    for every process. Without encoder processes each worker also runs the vision tower, and counts twice (on 2
    cores such a worker at both threads served 25-30 % fewer tokens than at one, its tower and steps on one core
    each; docs/decisions.md)."""
    computing = (spec.encoders or spec.workers) + spec.workers + spec.prefill_workers
    return max(1, cores // computing)


def _spawn_cluster(
    spec: ClusterSpec, ports: PortPlan, redis_process: subprocess.Popen | None, spawned: list[Process]
) -> LocalCluster:
    """Spawn encoders, workers, then the router (each appended to `spawned` as it starts)."""
    log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="epd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = torch_threads(spec, os.cpu_count() or 1)
    base = {
        "EPD_MODEL": str(spec.model_dir),
        "EPD_REDIS_URL": spec.redis_url,
        "EPD_TORCH_THREADS": str(threads),
        **spec.env,
    }
    metrics = iter(ports.metrics)

    def start(role: str, port: int, env: dict[str, str]) -> Process:
        spawned.append(spawn(role, port, next(metrics), env, log_dir))
        return spawned[-1]

    encoders = [start("encoder", p, base) for p in ports.encoders]
    router_env = {**base}
    worker_env = base
    if spec.prefill_workers:  # P/D: the workers decode, the prefill pool prefills what the router sends it
        worker_env = {"EPD_WORKER_ROLE": "decode", **base}
        router_env = {"EPD_PD_MIN_PREFILL_TOKENS": str(spec.pd_min_prefill_tokens), **base}
    workers = [start("worker", p, worker_env) for p in ports.workers]
    prefill = [start("worker", p, {**base, "EPD_WORKER_ROLE": "prefill"}) for p in ports.prefill]
    encoder_addrs = ",".join(p.address for p in encoders)
    router = start(
        "router", ports.router, {**router_env, "EPD_ENCODER_ADDRS": encoder_addrs, "EPD_HTTP_PORT": str(ports.http)}
    )
    return LocalCluster(
        router, encoders, workers, spec.redis_url, redis_process, http_port=ports.http, prefill_workers=prefill
    )


def _wait_ready(
    processes: list[Process],
    timeout_s: float,
    on_ready: Callable[[Process], None],
    cancelled: threading.Event | None = None,
) -> None:
    """Poll every service's health until all serve, reporting each once; raise _NotReady on death or timeout,
    StartCancelled once `cancelled` is set."""
    pending = list(processes)
    deadline = time.monotonic() + timeout_s
    while pending:
        if cancelled is not None and cancelled.is_set():
            raise StartCancelled
        for process in list(pending):
            code = process.popen.poll()
            if code is not None:
                raise _NotReady(process, f"exited with code {code} during start-up")
            if check(process.address, timeout_s=1.0, tls=client_from_env({**os.environ, **process.env})):
                pending.remove(process)
                on_ready(process)
        if pending and time.monotonic() >= deadline:
            raise _NotReady(pending[0], f"was not healthy within {timeout_s:g}s")
        if pending:
            time.sleep(0.2)


def _stop_popens(popens: list[subprocess.Popen | forkserver.ForkedProcess], grace_s: float) -> None:
    """SIGTERM each running one, then SIGKILL what is left after `grace_s`."""
    for popen in popens:
        if popen.poll() is None:
            popen.terminate()
    deadline = time.monotonic() + grace_s
    for popen in popens:
        try:
            popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
