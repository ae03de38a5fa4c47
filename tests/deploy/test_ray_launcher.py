"""services/launch/ray_launcher.py on a local Ray with a stand-in service: start, health on every address, clean stop.

The real services as Ray actors answering an image request: tests/e2e/test_up_ray.py (`epd up --ray`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launch.local_redis import redis_answers
from services.launch.ray_launcher import RayCluster, _local_redis, launch_on_ray, plan_services
from services.launch.service_process import descendants, free_port, is_alive

FAKE_EPD = Path(__file__).resolve().parent / "fake_epd.py"


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if is_alive(p)]
    return alive


def stop_and_check_clean(cluster: RayCluster, before: set[int]) -> None:
    """Stop the cluster; every service process, its descendants and Ray itself must be gone."""
    service_pids = [p for pids in cluster.service_pids().values() for p in pids]
    assert service_pids
    cluster.stop()
    assert wait_gone(service_pids) == []
    left = wait_gone([p for p in descendants(os.getpid()) if p not in before])
    assert left == [], f"processes left under the test process: {left}"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A private Redis for the real services (redis-server must be installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_plan_requests_gpus_only_for_cuda() -> None:
    kwargs = dict(
        router_port=50051,
        encoder_port=50061,
        worker_port=50071,
        metrics_port=9400,
        cpus_per_service=1.0,
        gpus_per_encoder=1.0,
        gpus_per_worker=1.0,
    )
    cuda = plan_services(2, 3, device="cuda", **kwargs)
    assert [(s.name, s.port, s.num_gpus) for s in cuda] == [
        ("encoder-0", 50061, 1.0),
        ("encoder-1", 50062, 1.0),
        ("worker-0", 50071, 1.0),
        ("worker-1", 50072, 1.0),
        ("worker-2", 50073, 1.0),
        ("router-0", 50051, 0.0),
    ]
    assert len({s.metrics_port for s in cuda}) == len(cuda)
    assert all(s.num_gpus == 0 for s in plan_services(1, 1, device="cpu", **kwargs))
    with pytest.raises(ValueError, match="EPD_DEVICE"):
        plan_services(1, 1, device="tpu", **kwargs)


def test_launch_wires_services_and_stops_every_process(tmp_path: Path) -> None:
    """Services find each other through one Redis (started here: nothing answers at the URL)."""
    before = set(descendants(os.getpid()))
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    cluster = launch_on_ray(
        str(tmp_path),
        encoders=2,
        workers=2,
        router_port=0,
        http_port=None,
        encoder_port=0,
        worker_port=0,
        metrics_port=0,
        redis_url=redis_url,
        env={"EPD_LOG_LEVEL": "DEBUG", "EPD_REDIS_URL": "redis://elsewhere:6379/0"},
        command=[sys.executable, str(FAKE_EPD)],
        ready_timeout_s=60,
    )
    try:
        assert cluster.redis_url == redis_url and redis_answers(redis_url)
        addresses = cluster.addresses()
        assert [len(addresses[r]) for r in ("router", "encoder", "worker")] == [1, 2, 2]
        for address in sum(addresses.values(), []):
            assert serving(address)
        reports = {}
        for log in Path(cluster.log_dir).glob("*.log"):
            report = json.loads(log.read_text().splitlines()[0])
            reports[log.stem] = report
        assert len(reports) == 5
        for name, report in reports.items():
            assert report["env"]["EPD_REDIS_URL"] == redis_url, name
            assert "EPD_WORKER_ADDRS" not in report["env"], name
        router = reports["router-0"]["env"]
        assert router["EPD_ENCODER_ADDRS"].split(",") == addresses["encoder"]
        assert router["EPD_ADVERTISE_ADDR"] == cluster.router_addr
        assert router["EPD_LOG_LEVEL"] == "DEBUG" and router["EPD_MODEL"] == str(tmp_path)
        workers = sorted(reports[f"worker-{i}"]["env"]["EPD_ADVERTISE_ADDR"] for i in range(2))
        assert workers == sorted(addresses["worker"])
        helpers = [r["helper_pid"] for r in reports.values()]
        assert all(is_alive(p) for p in helpers)
    finally:
        stop_and_check_clean(cluster, before)
    assert not any(is_alive(p) for p in helpers)
    assert not redis_answers(redis_url)


def test_redis_is_started_only_for_a_silent_loopback_url(redis_url: str) -> None:
    assert _local_redis(redis_url) is None  # something answers there
    assert _local_redis("redis://redis.internal:6379/0") is None  # not ours to start


def test_failed_start_reports_the_log_and_cleans_up(tmp_path: Path) -> None:
    before = set(descendants(os.getpid()))
    with pytest.raises(RuntimeError, match="exited with") as caught:
        launch_on_ray(
            str(tmp_path),
            router_port=0,
            http_port=None,
            encoder_port=0,
            worker_port=0,
            metrics_port=0,
            redis_url=f"redis://127.0.0.1:{free_port()}/0",
            command=[sys.executable, "-c", "import sys; print('no such role'); sys.exit(3)"],
            ready_timeout_s=30,
        )
    assert "no such role" in str(caught.value)
    assert wait_gone([p for p in descendants(os.getpid()) if p not in before]) == []
