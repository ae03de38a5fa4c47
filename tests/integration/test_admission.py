"""Admission under overload, with real workers whose KV holds only a few requests.

Each worker has 64 KV blocks of 16 tokens; a request projects ~400 tokens (25 blocks), so each
worker holds two at once and the cluster four. Offered load is twice that.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.client import Client, user_request
from services.common.registry import Registry
from services.launch.health import wait_healthy
from services.launch.local import ClusterSpec, LocalCluster, Process, free_port, spawn, start_cluster
from tests.integration.conftest import RedisServer
from tests.kv_sampler import KVSampler

BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # K and V x layers x kv heads x head dim x block size x fp32
KV_BLOCKS = 64
MAX_TOKENS = 150
PROMPT = " ".join(["describe the bright window near the small table"] * 10)


@dataclass
class Outcome:
    tokens: int = 0
    code: grpc.StatusCode | None = None
    details: str = ""
    retry_after_ms: str | None = None
    seconds: float = 0.0


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, Process]]:
    log_dir = tmp_path_factory.mktemp("logs")
    env = {"EPD_KV_CACHE_BYTES": str(KV_BLOCKS * BLOCK_BYTES), "EPD_ADMISSION_MAX_WAIT_S": "0.5"}
    local = start_cluster(
        ClusterSpec(tiny_model_dir, workers=2, redis_url=redis_server.url, free_ports=True, env=env, log_dir=log_dir)
    )
    base = {"EPD_MODEL": str(tiny_model_dir), "EPD_REDIS_URL": redis_server.url, "EPD_HTTP_PORT": "0", **env}
    second_router = spawn("router", free_port(), free_port(), base, log_dir)
    wait_healthy(second_router.address, 120)
    yield local, second_router
    second_router.popen.terminate()
    second_router.popen.wait(10)
    local.stop()


def _one(address: str, index: int) -> Outcome:
    request = user_request(f"{index} {PROMPT}", max_tokens=MAX_TOKENS)
    request.sampling.ignore_eos = True
    start = time.perf_counter()
    with Client(address) as client:
        try:
            answer = client.generate(request, timeout_s=120)
            return Outcome(tokens=len(answer.token_ids), seconds=time.perf_counter() - start)
        except grpc.RpcError as exc:
            trailing = dict(exc.trailing_metadata() or ())
            return Outcome(
                code=exc.code(),
                details=exc.details(),
                retry_after_ms=trailing.get("retry-after-ms"),
                seconds=time.perf_counter() - start,
            )


def _burst(addresses: list[str], count: int, redis_url: str) -> tuple[list[Outcome], list[dict]]:
    with KVSampler(Registry(redis_url)) as sampler, ThreadPoolExecutor(count) as pool:
        outcomes = list(pool.map(lambda i: _one(addresses[i % len(addresses)], i), range(count)))
    return outcomes, sampler.states


def _check_never_over_reserved(states: list[dict]) -> None:
    assert states, "no worker state was sampled"
    for state in states:
        assert state["total_blocks"] == KV_BLOCKS
        assert state["reserved_blocks"] <= state["capacity_blocks"] == KV_BLOCKS, state
        assert 0 <= state["free_blocks"] <= state["total_blocks"], state


def _check_outcomes(outcomes: list[Outcome]) -> list[Outcome]:
    refused = [o for o in outcomes if o.code is not None]
    for o in outcomes:
        if o.code is None:
            assert o.tokens == MAX_TOKENS
        else:
            assert o.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (o.code, o.details)
            assert o.retry_after_ms is not None and int(o.retry_after_ms) > 0
            assert "KV blocks" in o.details or "queue" in o.details
    return refused


def test_overload_is_refused_fast_and_never_over_reserves(cluster, redis_server: RedisServer) -> None:
    local, _ = cluster
    half, half_states = _burst([local.address], 4, redis_server.url)  # exactly what the KV holds
    assert all(o.code is None for o in half), [o.details for o in half]
    double, states = _burst([local.address], 8, redis_server.url)
    _check_never_over_reserved(half_states + states)
    refused = _check_outcomes(double)
    assert 1 <= len(refused) <= 6
    # with one router the view is exact, so every refusal is decided at once, never after queueing
    assert all("unreserved KV blocks" in o.details for o in refused), [o.details for o in refused]
    assert all(s["preemptions"] == 0 for s in half_states + states), states


def test_two_routers_never_over_admit(cluster, redis_server: RedisServer) -> None:
    local, second = cluster
    outcomes, states = _burst([local.address, second.address], 16, redis_server.url)
    _check_never_over_reserved(states)
    refused = _check_outcomes(outcomes)
    assert len(refused) < 16
    assert max(state["running"] + state["waiting"] for state in states) <= 2


def test_never_fits_is_failed_precondition(cluster) -> None:
    local, _ = cluster
    request = user_request("hello", max_tokens=KV_BLOCKS * 16 + 1)
    with Client(local.address) as client, pytest.raises(grpc.RpcError) as info:
        client.generate(request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV blocks" in info.value.details()


def test_prefix_affinity_reuses_the_workers_cache(cluster) -> None:
    local, _ = cluster
    shared = " ".join(["the long shared system prefix about windows and tables"] * 6)
    with Client(local.address) as client:
        first = client.generate(user_request(shared + " question one", max_tokens=4))
        second = client.generate(user_request(shared + " question two", max_tokens=4))
    # the second lands on the worker that holds the shared prefix (several blocks more than the template)
    assert second.final.usage.cached_tokens >= first.final.usage.cached_tokens + 16 * 3, (first.final, second.final)


def test_client_cancel_frees_blocks(cluster, redis_server: RedisServer) -> None:
    local, _ = cluster
    # 800 tokens (most of a worker's 64 blocks): still running through several heartbeats however busy the box
    request = user_request("cancel me " + PROMPT, max_tokens=800)
    request.sampling.ignore_eos = True
    registry = Registry(redis_server.url)
    with Client(local.address) as client:
        stream = client.stream(request, timeout_s=60)
        next(stream)  # the first chunk: the request holds blocks now
        seen = time.monotonic() + 10
        while not any(m.state["reserved_blocks"] > 0 for m in registry.members("worker")):
            assert time.monotonic() < seen, "the running request's blocks never showed in a heartbeat"
            time.sleep(0.02)
        stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [m.state for m in registry.members("worker")]
        if all(s["reserved_blocks"] == 0 and s["running"] == 0 and s["waiting"] == 0 for s in states):
            break
        time.sleep(0.1)
    assert all(s["reserved_blocks"] == 0 and s["running"] == 0 for s in states), states
