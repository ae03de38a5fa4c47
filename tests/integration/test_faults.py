"""Faults under load: kill -9 an encoder, stop Redis, kill -9 a worker.

Clients keep sending image requests (new images, so encoders stay busy) the whole time. Every
request must end within the router's deadline with tokens or a clear status, and the cluster must
serve normally after each fault. The phases run in order on one cluster (2 encoders, 2 workers).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.client import Client, user_request
from services.common.rpc.epd.v1 import generation_pb2
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from tests import media_factory
from tests.integration.conftest import RedisServer
from tests.reliability_support import Load, Outcome

DEADLINE_S = 20.0
CLEAR = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


def _request(i: int) -> generation_pb2.GenerateRequest:
    """Request `i`: a new image two times in three (so encoders stay busy), else text only."""
    seed = 1000 + i
    images = [media_factory.png(64 + seed % 50, 48 + seed % 30, seed=seed)] if seed % 3 else []
    return user_request(f"request {seed}", images, max_tokens=8)


def _load(cluster: LocalCluster, clients: int = 4) -> Load:
    return Load([cluster.address], _request, clients=clients, timeout_s=DEADLINE_S * 3)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[LocalCluster]:
    local = start_cluster(
        ClusterSpec(
            tiny_model_dir,
            encoders=2,
            workers=2,
            redis_url=redis_server.url,
            free_ports=True,
            env={"EPD_REQUEST_TIMEOUT_S": str(DEADLINE_S)},
            log_dir=tmp_path_factory.mktemp("logs"),
        )
    )
    yield local
    local.stop()


def _check(results: list[Outcome], phase: str) -> None:
    assert results, f"{phase}: no request completed"
    for r in results:
        assert r.seconds < DEADLINE_S + 2, f"{phase}: a request took {r.seconds:.1f}s ({r.code}: {r.details})"
        if not r.ok:
            assert r.code in CLEAR, f"{phase}: unclear failure {r.code}: {r.details}"
            assert r.details, f"{phase}: failure without a message"
    assert sum(r.ok for r in results) >= len(results) // 2, f"{phase}: most requests failed"


_FRESH_SEEDS = itertools.count(5000)


def _serves_normally(cluster: LocalCluster) -> None:
    """Three requests with never-seen images (so they must be encoded) all succeed."""
    with Client(cluster.address) as client:
        for seed in itertools.islice(_FRESH_SEEDS, 3):
            answer = client.generate(
                user_request("after", [media_factory.png(70, 70, seed=seed)], max_tokens=6), timeout_s=DEADLINE_S
            )
            assert len(answer.token_ids) > 0 and answer.final.usage.image_tokens > 0


def test_encoder_killed_under_load(cluster: LocalCluster) -> None:
    with _load(cluster) as load:
        time.sleep(2)
        os.kill(cluster.encoders[0].popen.pid, signal.SIGKILL)
        time.sleep(4)
    _check(load.outcomes, "encoder kill")
    _serves_normally(cluster)


def test_redis_stopped_under_load(cluster: LocalCluster, redis_server: RedisServer) -> None:
    with _load(cluster) as load:
        time.sleep(1)
        redis_server.stop()
        time.sleep(3)
        redis_server.start()
        time.sleep(2)
    _check(load.outcomes, "redis stop")
    time.sleep(1)
    _serves_normally(cluster)


def test_worker_killed_under_load(cluster: LocalCluster) -> None:
    with _load(cluster) as load:
        time.sleep(2)
        os.kill(cluster.workers[0].popen.pid, signal.SIGKILL)
        time.sleep(4)
    _check(load.outcomes, "worker kill")
    _serves_normally(cluster)


def test_all_encoders_gone_workers_encode_themselves(cluster: LocalCluster) -> None:
    for encoder in cluster.encoders:
        if encoder.popen.poll() is None:
            os.kill(encoder.popen.pid, signal.SIGKILL)
    with _load(cluster, clients=2) as load:
        time.sleep(4)
    _check(load.outcomes, "no encoders")
    assert all(r.ok for r in load.outcomes), {r.details for r in load.outcomes if not r.ok}
    _serves_normally(cluster)
