"""`epd up`: the whole cluster as subprocesses on 127.0.0.1.

Starts Redis when none answers (and `redis-server` exists), then encoders, workers and the
router, each as `epd serve <role>` with EPD_* settings; waits until every gRPC health check
says SERVING. Invariant: `LocalCluster.stop()` terminates every process it started (SIGTERM,
then SIGKILL after a grace period), Redis included when it started it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.launch.health import wait_healthy

ROUTER_PORT, ENCODER_PORT, WORKER_PORT, METRICS_PORT, HTTP_PORT = 50051, 50061, 50071, 9400, 8000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    encoders: int = 1
    workers: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"
    free_ports: bool = False  # tests: pick free ports instead of the documented defaults
    env: dict[str, str] = field(default_factory=dict)  # extra EPD_* settings for every service
    log_dir: Path | None = None


@dataclass
class Process:
    role: str
    address: str
    metrics_port: int
    popen: subprocess.Popen
    log_path: Path

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

    @property
    def http_url(self) -> str:
        """Base URL of the router's HTTP API (``http://127.0.0.1:<port>``)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def processes(self) -> list[Process]:
        return [self.router, *self.encoders, *self.workers]

    @property
    def address(self) -> str:
        return self.router.address

    def stop(self, grace_s: float = 5.0) -> None:
        popens = [p.popen for p in reversed(self.processes)]
        if self.redis_process is not None:
            popens.append(self.redis_process)
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


def redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        ok = bool(client.ping())
        client.close()
        return ok
    except (redis.RedisError, OSError):
        return False


def ensure_redis(url: str) -> subprocess.Popen | None:
    """Return None when Redis at `url` answers; else start redis-server on its port and return it."""
    if redis_answers(url):
        return None
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError(f"no Redis answers at {url} and redis-server is not installed")
    port = redis.connection.parse_url(url).get("port", 6379)
    popen = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(50):
        if redis_answers(url):
            return popen
        time.sleep(0.1)
    popen.kill()
    raise RuntimeError(f"started redis-server but {url} does not answer")


def spawn(role: str, port: int, metrics_port: int, env: dict[str, str], log_dir: Path) -> Process:
    log_path = log_dir / f"{role}-{port}.log"
    child_env = {
        **os.environ,
        **env,
        "EPD_PORT": str(port),
        "EPD_METRICS_PORT": str(metrics_port),
        "EPD_HOST": "127.0.0.1",
        "EPD_ADVERTISE_ADDR": f"127.0.0.1:{port}",
    }
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", role],
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    return Process(role, f"127.0.0.1:{port}", metrics_port, popen, log_path)


def start_cluster(spec: ClusterSpec, timeout_s: float = 180.0) -> LocalCluster:
    """Start everything and wait for health; on failure stop what started and raise with logs."""
    redis_process = ensure_redis(spec.redis_url)
    log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="epd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def port(default: int) -> int:
        return free_port() if spec.free_ports else default

    # services share this box's cores: split them instead of letting every process use all of them
    threads = max(1, (os.cpu_count() or 1) // (spec.encoders + spec.workers))
    base = {
        "EPD_MODEL": str(spec.model_dir),
        "EPD_REDIS_URL": spec.redis_url,
        "EPD_TORCH_THREADS": str(threads),
        **spec.env,
    }
    metrics = iter(range(METRICS_PORT, METRICS_PORT + 1 + spec.encoders + spec.workers))
    encoders = [
        spawn("encoder", port(ENCODER_PORT + i), free_port() if spec.free_ports else next(metrics), base, log_dir)
        for i in range(spec.encoders)
    ]
    workers = [
        spawn("worker", port(WORKER_PORT + i), free_port() if spec.free_ports else next(metrics), base, log_dir)
        for i in range(spec.workers)
    ]
    http_port = int(spec.env["EPD_HTTP_PORT"]) if "EPD_HTTP_PORT" in spec.env else port(HTTP_PORT)
    router_env = {**base, "EPD_ENCODER_ADDRS": ",".join(p.address for p in encoders), "EPD_HTTP_PORT": str(http_port)}
    router = spawn("router", port(ROUTER_PORT), free_port() if spec.free_ports else next(metrics), router_env, log_dir)
    cluster = LocalCluster(router, encoders, workers, spec.redis_url, redis_process, http_port=http_port)
    try:
        for process in cluster.processes:
            wait_healthy(process.address, timeout_s, alive=lambda p=process: p.popen.poll() is None)
    except Exception as exc:
        tails = "\n".join(f"--- {p.role} {p.address} ---\n{p.log_tail()}" for p in cluster.processes)
        cluster.stop()
        raise RuntimeError(f"cluster did not become healthy: {exc}\n{tails}") from exc
    return cluster
