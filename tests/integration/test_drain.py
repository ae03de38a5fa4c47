"""Graceful drain on SIGTERM: a rolling restart of every service under load loses nothing.

One cluster for the module: 2 routers (the client balances over both, retrying UNAVAILABLE before an answer
as a client behind router replicas does), 2 encoders, 2 workers, every service supervised as `epd up` does.
SIGTERM drains a service (docs/reliability.md) and the supervisor starts it again. A worker whose drain
timeout passes ends its requests and their routers migrate them: outputs stay token for token the same.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2_grpc
from services.launch import local
from services.launch.health import wait_healthy
from services.launch.supervisor import Supervisor
from tests.integration.conftest import RedisServer
from tests.reliability_support import (
    Load,
    StreamsStarted,
    describe,
    image_request,
    metric_by_label,
    run_all,
    settled_workers,
    text_request,
)


@dataclass
class Replicated:
    cluster: local.LocalCluster
    second_router: local.Process

    @property
    def routers(self) -> list[local.Process]:
        return [self.cluster.router, self.second_router]

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.routers]

    @property
    def processes(self) -> list[local.Process]:
        return [*self.routers, *self.cluster.encoders, *self.cluster.workers]


@pytest.fixture(scope="module")
def replicated(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[Replicated]:
    log_dir = tmp_path_factory.mktemp("logs")
    spec = local.ClusterSpec(
        tiny_model_dir, encoders=2, workers=2, redis_url=redis_server.url, free_ports=True, log_dir=log_dir
    )
    cluster = local.start_cluster(spec)
    env = {**cluster.router.env, "EPD_HTTP_PORT": "0"}
    second = local.spawn("router", local.free_port(), local.free_port(), env, log_dir)
    replicated = Replicated(cluster, second)
    try:
        wait_healthy(second.address, 120, lambda: second.popen.poll() is None)
        with Supervisor(replicated.processes, report=lambda line: None):
            yield replicated
    finally:
        second.popen.terminate()
        second.popen.wait(30)
        cluster.stop()


def _restart(process: local.Process) -> None:
    """SIGTERM `process` (it drains and exits) and wait until the supervisor's new one serves."""
    old = process.popen
    os.kill(old.pid, signal.SIGTERM)
    _restarted(process, old)


def _restarted(process: local.Process, old: object) -> None:
    """Wait until the supervisor replaced `old` (which must have exited 0) and the new process serves."""
    deadline = time.monotonic() + 180
    while process.popen is old and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.popen is not old, f"{process.role} at {process.address} was not restarted"
    assert old.returncode == 0, f"{process.role} at {process.address} exited with {old.returncode} on SIGTERM"
    wait_healthy(process.address, 180, lambda: True)


def _registered(redis_url: str, role: str, address: str) -> None:
    registry = Registry(redis_url)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if any(m.address == address for m in registry.members(role) or []):
                return
            time.sleep(0.1)
    finally:
        registry.close()
    raise AssertionError(f"{role} {address} did not register again")


def test_rolling_restart_of_every_service_under_load_fails_nothing(replicated: Replicated) -> None:
    """The rolling restart: SIGTERM to each router, encoder and worker in turn while requests run: 0 failed. Each
    worker drains with the default timeout; its replacement starts with EPD_DRAIN_TIMEOUT_S=0, which the next test
    needs (and would otherwise restart both workers for)."""
    cluster = replicated.cluster
    settled_workers(cluster.redis_url, 2)

    def make(i: int):
        return image_request(30_000 + i, 32) if i % 2 else text_request(i, 32)

    with Load(replicated.addresses, make, clients=4) as load:
        time.sleep(2)
        for process in replicated.processes:
            if process.role == "worker":
                process.env = {**process.env, "EPD_DRAIN_TIMEOUT_S": "0"}  # the replacement's; this one drains as set
            _restart(process)
            if process.role != "router":
                _registered(cluster.redis_url, process.role, process.address)
            time.sleep(2)  # as a rollout waits for readiness: clients reconnect to it before the next one goes
    assert len(load.outcomes) >= 12, len(load.outcomes)
    assert not load.failures(), describe(load.failures())
    assert all(len(o.token_ids) == 32 for o in load.outcomes)
    settled_workers(cluster.redis_url, 2)


def test_drain_timeout_ends_requests_and_their_routers_migrate_them(replicated: Replicated) -> None:
    """Workers with EPD_DRAIN_TIMEOUT_S=0: SIGTERM to the busy one ends its streams at once; each continues on
    the other worker (reason `drain`), token for token as in an undisturbed run."""
    cluster = replicated.cluster
    for worker in cluster.workers:  # a drain timeout of 0: from the rolling restart, else restarted idle with it
        if worker.env.get("EPD_DRAIN_TIMEOUT_S") != "0":
            worker.env = {**worker.env, "EPD_DRAIN_TIMEOUT_S": "0"}
            _restart(worker)
    settled_workers(cluster.redis_url, 2)
    router = [cluster.address]
    calm = run_all(router, [image_request(i, 120, salt="calm") for i in range(8)])
    assert all(o.ok for o in calm), describe([o for o in calm if not o.ok])
    drains_before = metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason").get("drain", 0)
    on_chunk = StreamsStarted(8)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, router, [image_request(i, 120, salt="drained") for i in range(8)], 120, on_chunk)
        on_chunk.wait(120)
        registry = Registry(cluster.redis_url)
        busy = max(registry.members("worker") or [], key=lambda m: m.state["running"]).address
        registry.close()
        os.kill(next(w for w in cluster.workers if w.address == busy).popen.pid, signal.SIGTERM)
        drained = running.result()
    assert all(o.ok for o in drained), describe([o for o in drained if not o.ok])
    assert [o.token_ids for o in drained] == [o.token_ids for o in calm]
    drains = metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason").get("drain", 0)
    assert drains - drains_before == sum(o.migrations for o in drained) > 0
    for worker in cluster.workers:
        wait_healthy(worker.address, 180, lambda: True)
    settled_workers(cluster.redis_url, 2)


def _stream_chat(url: str, max_tokens: int, started: threading.Event) -> tuple[int, bool, float]:
    """Stream one greedy chat over HTTP; returns (completion tokens in usage, [DONE] seen, when it ended)."""
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, done = 0, False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                started.set()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens, done, time.monotonic()


def test_an_http_stream_finishes_while_its_router_drains(replicated: Replicated) -> None:
    """SIGTERM to the router while an HTTP stream runs, its workers paused (SIGSTOP) for 3 s right then: the
    stream still ends whole, [DONE] included, since the HTTP API drains for EPD_DRAIN_TIMEOUT_S (30 s here),
    as gRPC does (a fixed 2 s grace cut it off). 3 s is below the 1 s heartbeat TTL + 3 s after which the
    router would take a silent worker for gone, so nothing migrates meanwhile."""
    cluster = replicated.cluster
    for worker in cluster.workers:  # both up (an earlier test restarts them)
        wait_healthy(worker.address, 180, lambda: True)
    settled_workers(cluster.redis_url, 2)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream_chat, f"http://127.0.0.1:{cluster.http_port}", 2000, started)
        if not started.wait(60):
            raise AssertionError(f"the stream never started: {running.exception(timeout=60)!r}")
        router = cluster.router.popen
        for worker in cluster.workers:
            os.kill(worker.popen.pid, signal.SIGSTOP)
        try:
            os.kill(router.pid, signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(3)
        finally:
            for worker in cluster.workers:
                os.kill(worker.popen.pid, signal.SIGCONT)
        tokens, done, ended = running.result(timeout=120)
    assert (tokens, done) == (2000, True)
    assert ended - signalled > 3
    _restarted(cluster.router, router)


def test_a_draining_router_answers_new_calls_unavailable_while_its_streams_finish(replicated: Replicated) -> None:
    """SIGTERM to a router while a gRPC stream runs through it (its workers paused for 2 s, so the stream is
    still running): its health turns NOT_SERVING and a new call to it is answered UNAVAILABLE naming the drain
    (a client retries that on another router; a gRPC server that is already stopping cancels such a call
    instead, which CI saw fail the rolling restart), and the stream in flight still ends whole."""
    cluster, process = replicated.cluster, replicated.second_router
    for worker in cluster.workers:
        wait_healthy(worker.address, 180, lambda: True)
    settled_workers(cluster.redis_url, 2)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, [process.address], [text_request(3, 1500)], 120, lambda i: started.set())
        if not started.wait(60):
            raise AssertionError(f"the stream never started: {running.exception(timeout=60)!r}")
        router = process.popen
        for worker in cluster.workers:
            os.kill(worker.popen.pid, signal.SIGSTOP)
        try:
            os.kill(router.pid, signal.SIGTERM)
            time.sleep(0.5)
            with grpc.insecure_channel(process.address) as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="epd.v1.Generation"), timeout=10
                )
                with pytest.raises(grpc.RpcError) as refused:
                    generation_pb2_grpc.GenerationStub(channel).CountTokens(text_request(4, 8), timeout=10)
        finally:
            for worker in cluster.workers:
                os.kill(worker.popen.pid, signal.SIGCONT)
        [outcome] = running.result(timeout=120)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert "router is draining" in refused.value.details()
    assert outcome.ok, describe([outcome])
    assert len(outcome.token_ids) == 1500
    _restarted(process, router)
