"""Run the epd cluster (router, encoders, workers as `epd serve <role>`) inside Ray actors.

Each service is one actor holding one child process (services/launch/service_process.py). With
EPD_DEVICE=cuda, encoder and worker actors request GPUs, so Ray places them on GPU nodes and
sets CUDA_VISIBLE_DEVICES for their process. On an existing cluster (`address`), services bind
0.0.0.0 and advertise their node's IP; every node needs epd installed and the model folder at
the same path. Without an address a local Ray instance is started and shut down by `stop()`.

Every service gets the same EPD_REDIS_URL: the router finds workers and encoders in the Redis
registry they heartbeat into. When nothing answers at a loopback `redis_url` and `redis-server`
is installed, a Redis is started on that port (`services.launch.local_redis.ensure_redis`) and
`stop()` stops it too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from services.launch.service_process import HealthReport, ServiceProcess

ROLES = ("router", "encoder", "worker")
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class RayLaunchError(RuntimeError):
    """A service did not become healthy; the message carries each failure and its log tail."""


@dataclass(frozen=True)
class ServiceSpec:
    """One service to run: its role, name, ports and Ray resources."""

    role: str
    name: str
    port: int
    metrics_port: int
    num_cpus: float
    num_gpus: float
    http_port: int | None = None  # the router's HTTP port (-1: a free one); None for other roles


@dataclass
class RayCluster:
    """Handle on a launched cluster. `stop()` ends every service process, then the Ray instance
    and the Redis server when this launch started them (idempotent)."""

    router_addr: str
    encoder_addrs: list[str]
    worker_addrs: list[str]
    log_dir: str
    redis_url: str
    _actors: dict[str, Any] = field(repr=False)
    _owns_ray: bool = field(repr=False)
    _redis: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def addresses(self) -> dict[str, list[str]]:
        return {"router": [self.router_addr], "encoder": list(self.encoder_addrs), "worker": list(self.worker_addrs)}

    def service_pids(self) -> dict[str, list[int]]:
        """Live pids (each service's process and its descendants) by service name."""
        import ray

        names = list(self._actors)
        pids = ray.get([self._actors[n].pids.remote() for n in names])
        return dict(zip(names, pids, strict=True))

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        import ray

        try:
            ray.get([actor.stop.remote(timeout_s) for actor in self._actors.values()])
        finally:
            try:
                for actor in self._actors.values():
                    ray.kill(actor)
                if self._owns_ray:
                    ray.shutdown()
            finally:
                _stop_redis(self._redis, timeout_s)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def plan_services(
    encoders: int,
    workers: int,
    *,
    router_port: int,
    encoder_port: int,
    worker_port: int,
    metrics_port: int | None,
    device: str,
    cpus_per_service: float,
    gpus_per_encoder: float,
    gpus_per_worker: float,
    http_port: int | None = 8000,
) -> list[ServiceSpec]:
    """Services in start order. A base port p > 0 gives p, p+1, ...; 0 picks free ports per node.

    `metrics_port`: None picks free ports, 0 turns metrics off, p > 0 numbers them from p. `http_port` is
    the router's OpenAI HTTP port: None picks a free one, 0 turns it off.
    """
    if encoders < 0 or workers < 1:  # no encoder: each worker encodes its own images (co-located)
        raise ValueError(f"encoders must be >= 0 and workers >= 1, got {encoders} and {workers}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"EPD_DEVICE must be cpu or cuda, got {device!r}")
    gpu = device == "cuda"
    rows = [("encoder", i, encoder_port, gpus_per_encoder) for i in range(encoders)]
    rows += [("worker", i, worker_port, gpus_per_worker) for i in range(workers)]
    rows += [("router", 0, router_port, 0.0)]
    specs = []
    for offset, (role, index, base, gpus) in enumerate(rows):
        metrics = -1 if metrics_port is None else (0 if metrics_port == 0 else metrics_port + offset)
        http = (-1 if http_port is None else http_port) if role == "router" else None
        specs.append(
            ServiceSpec(
                role=role,
                name=f"{role}-{index}",
                port=base + index if base else 0,
                metrics_port=metrics,
                num_cpus=cpus_per_service,
                num_gpus=gpus if gpu else 0.0,
                http_port=http,
            )
        )
    return specs


def launch_on_ray(
    model_dir: str | os.PathLike[str],
    *,
    encoders: int = 1,
    workers: int = 1,
    redis_url: str | None = None,
    address: str | None = None,
    host: str | None = None,
    router_port: int = 50051,
    encoder_port: int = 50061,
    worker_port: int = 50071,
    metrics_port: int | None = 9400,
    http_port: int | None = 8000,
    env: Mapping[str, str] | None = None,
    cpus_per_service: float = 1.0,
    gpus_per_encoder: float = 1.0,
    gpus_per_worker: float = 1.0,
    command: Sequence[str] | None = None,
    ready_timeout_s: float = 300.0,
    log_dir: str | None = None,
    start_redis: bool = True,
) -> RayCluster:
    """Start router, encoders and workers as Ray actors and wait until all serve gRPC health.

    `env` adds EPD_* (or other) variables for every service; EPD_DEVICE there (or in this
    process's environment) decides whether encoders and workers request GPUs. `redis_url`
    defaults to EPD_REDIS_URL from `env`, then from this process's environment; with
    `start_redis`, a loopback URL where nothing answers gets a redis-server of its own (when
    installed), stopped by `stop()`. `command` replaces `epd` (for tests). On failure everything
    started is stopped and RayLaunchError says which service failed and why.
    """
    import ray

    extra = dict(env or {})
    device = extra.get("EPD_DEVICE", os.environ.get("EPD_DEVICE", "cpu"))
    redis_url = redis_url or extra.get("EPD_REDIS_URL") or os.environ.get("EPD_REDIS_URL", DEFAULT_REDIS)
    specs = plan_services(
        encoders,
        workers,
        router_port=router_port,
        encoder_port=encoder_port,
        worker_port=worker_port,
        metrics_port=metrics_port,
        device=device,
        cpus_per_service=cpus_per_service,
        gpus_per_encoder=gpus_per_encoder,
        gpus_per_worker=gpus_per_worker,
        http_port=http_port,
    )
    owns_ray = _connect(ray, address, sum(s.num_cpus for s in specs))
    bind = host or ("127.0.0.1" if address is None else "0.0.0.0")
    logs = log_dir or tempfile.mkdtemp(prefix="epd-ray-")
    actor_cls = ray.remote(ServiceProcess)
    actors = {s.name: actor_cls.options(num_cpus=s.num_cpus, num_gpus=s.num_gpus).remote(s.name, logs) for s in specs}
    cluster = RayCluster("", [], [], logs, redis_url, actors, owns_ray)
    try:
        cluster._redis = _local_redis(redis_url) if start_redis else None
        placements = _place(ray, specs, actors, bind)
        cluster.encoder_addrs = [placements[s.name].advertise for s in specs if s.role == "encoder"]
        cluster.worker_addrs = [placements[s.name].advertise for s in specs if s.role == "worker"]
        cluster.router_addr = placements["router-0"].advertise
        shared = {
            **extra,
            "EPD_MODEL": str(model_dir),
            "EPD_REDIS_URL": redis_url,
            "EPD_HOST": bind,
            "EPD_DEVICE": device,
            "EPD_ENCODER_ADDRS": ",".join(cluster.encoder_addrs),
        }
        ray.get(
            [
                actors[s.name].start.remote(
                    list(command) if command else None, s.role, {**shared, **placements[s.name].env()}
                )
                for s in specs
            ]
        )
        _wait_healthy(ray, specs, actors, placements, ready_timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@dataclass(frozen=True)
class Placement:
    """Where a service listens: its advertised host:port, the port on its node, its metrics port."""

    advertise: str
    local: str
    port: int
    metrics_port: int
    http_port: int | None = None  # the router's HTTP port

    def env(self) -> dict[str, str]:
        env = {
            "EPD_PORT": str(self.port),
            "EPD_METRICS_PORT": str(self.metrics_port),
            "EPD_ADVERTISE_ADDR": self.advertise,
        }
        if self.http_port is not None:
            env["EPD_HTTP_PORT"] = str(self.http_port)
        return env


def _local_redis(url: str) -> subprocess.Popen[bytes] | None:
    """A redis-server started for a loopback `url` nobody answers at; None when not needed or possible."""
    from services.launch.local_redis import ensure_redis

    if urlsplit(url).hostname not in LOOPBACK_HOSTS or shutil.which("redis-server") is None:
        return None
    return ensure_redis(url)


def _stop_redis(popen: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Terminate a redis-server `_local_redis` started (SIGKILL after `timeout_s`)."""
    if popen is None or popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def _connect(ray: Any, address: str | None, cpus_needed: float) -> bool:
    """Join `address`, reuse an initialised Ray, or start a local one; True when we started it."""
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return False
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
    )
    return True


def _place(ray: Any, specs: list[ServiceSpec], actors: dict[str, Any], bind: str) -> dict[str, Placement]:
    """Each service's Placement, free ports chosen on its own node (never twice on one node)."""
    node_ips = ray.get([actors[s.name].node_ip.remote() for s in specs])
    taken: set[tuple[str, int]] = {(ip, s.port) for s, ip in zip(specs, node_ips, strict=True) if s.port}
    taken |= {(ip, s.metrics_port) for s, ip in zip(specs, node_ips, strict=True) if s.metrics_port > 0}
    taken |= {(ip, s.http_port) for s, ip in zip(specs, node_ips, strict=True) if s.http_port}

    def pick(actor: Any, node_ip: str) -> int:
        for _ in range(50):
            port = int(ray.get(actor.free_port.remote()))
            if (node_ip, port) not in taken:
                taken.add((node_ip, port))
                return port
        raise RayLaunchError(f"no free port found on {node_ip}")

    placements = {}
    for spec, node_ip in zip(specs, node_ips, strict=True):
        port = spec.port or pick(actors[spec.name], node_ip)
        metrics = spec.metrics_port if spec.metrics_port >= 0 else pick(actors[spec.name], node_ip)
        http = spec.http_port
        if http is not None and http < 0:
            http = pick(actors[spec.name], node_ip)
        wildcard = bind == "0.0.0.0"
        placements[spec.name] = Placement(
            advertise=f"{node_ip if wildcard else bind}:{port}",
            local=f"{'127.0.0.1' if wildcard else bind}:{port}",
            port=port,
            metrics_port=metrics,
            http_port=http,
        )
    return placements


def _wait_healthy(
    ray: Any, specs: list[ServiceSpec], actors: dict[str, Any], placements: dict[str, Placement], timeout_s: float
) -> None:
    """Wait (on each service's own node) for SERVING; raise RayLaunchError naming the failures."""
    reports: list[HealthReport] = ray.get(
        [actors[s.name].wait_healthy.remote(placements[s.name].local, timeout_s) for s in specs]
    )
    failed = [r.detail for r in reports if not r.ok]
    if failed:
        raise RayLaunchError("epd services failed to start on Ray:\n" + "\n\n".join(failed))
