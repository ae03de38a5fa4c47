"""No lost requests: a worker killed mid-stream, Redis restarted under load, the migration limit.

One cluster for the module (2 encoders, 2 workers, a router, and a second router with EPD_MIGRATION_LIMIT=1),
every service supervised as `epd up` does, so a killed worker comes back. Outputs are compared token for
token with the same requests in an undisturbed run (greedy, eos ignored, a cache salt per run so neither run
reuses the other's KV). After every fault each worker's free blocks return to the total, with nothing
reserved, running or pinned.
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
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common.grammar_cache import tokenizer_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2
from services.launch import local
from services.launch.health import wait_healthy
from services.launch.supervisor import Supervisor
from tests.bench.bench_engine import STRUCTURED_SCHEMA
from tests.integration.conftest import RedisServer
from tests.reliability_support import (
    Load,
    StreamsStarted,
    balanced_stub,
    describe,
    image_request,
    metric_by_label,
    run_all,
    settled_workers,
    stream_one,
    text_request,
)

STREAMS, TOKENS = 16, 160
CONSTRAINED = [i for i in range(STREAMS) if i % 4 in (1, 2)]
"""The kill test's requests held to a JSON schema: half, in pairs, so whichever way placement alternates between
the two workers each holds some of them."""


@dataclass
class Supervised:
    cluster: local.LocalCluster
    limited: local.Process  # a second router, EPD_MIGRATION_LIMIT=1
    supervisor: Supervisor


@pytest.fixture(scope="module")
def supervised(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[Supervised]:
    log_dir = tmp_path_factory.mktemp("logs")
    spec = local.ClusterSpec(
        tiny_model_dir, encoders=2, workers=2, redis_url=redis_server.url, free_ports=True, log_dir=log_dir
    )
    cluster = local.start_cluster(spec)
    env = {**cluster.router.env, "EPD_MIGRATION_LIMIT": "1", "EPD_HTTP_PORT": "0"}
    limited = local.spawn("router", local.free_port(), local.free_port(), env, log_dir)
    try:
        wait_healthy(limited.address, 120, lambda: limited.popen.poll() is None)
        with Supervisor([*cluster.processes, limited], report=lambda line: None) as supervisor:
            yield Supervised(cluster, limited, supervisor)
    finally:
        limited.popen.terminate()
        limited.popen.wait(30)
        cluster.stop()


def _all_serving(s: Supervised) -> None:
    """Every service (restarted ones too) answers health, and both workers are registered and idle."""
    for process in [*s.cluster.processes, s.limited]:
        wait_healthy(process.address, 180, lambda: True)
    settled_workers(s.cluster.redis_url, 2)


def _requests(salt: str) -> list[generation_pb2.GenerateRequest]:
    """The kill test's requests: those in CONSTRAINED hold their output to a JSON schema they cannot finish in
    TOKENS."""
    requests = [image_request(i, TOKENS, salt=salt) for i in range(STREAMS)]
    for i in CONSTRAINED:
        requests[i].sampling.json_schema = json.dumps(STRUCTURED_SCHEMA)
    return requests


def test_worker_killed_mid_stream_every_request_completes_unchanged(
    supervised: Supervised, tiny_model_dir: Path
) -> None:
    """Worker kill: 16 concurrent greedy image requests (half of them constrained by a JSON schema), kill -9 of
    a worker once every stream has tokens; the constrained outputs, migrated ones among them, are still what the
    schema allows."""
    cluster = supervised.cluster
    _all_serving(supervised)
    calm = run_all([cluster.address], _requests("calm"))
    assert all(o.ok and len(o.token_ids) == TOKENS for o in calm), describe([o for o in calm if not o.ok])
    assert sum(o.migrations for o in calm) == 0
    before = sum(metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason").values())
    on_chunk = StreamsStarted(STREAMS)

    requests = _requests("disturbed")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, [cluster.address], requests, 120.0, on_chunk)
        on_chunk.wait(120)
        os.kill(cluster.workers[0].popen.pid, signal.SIGKILL)
        disturbed = running.result()
    assert all(o.ok for o in disturbed), describe([o for o in disturbed if not o.ok])
    for quiet, moved in zip(calm, disturbed, strict=True):
        assert moved.token_ids == quiet.token_ids, f"request {moved.index} ({moved.migrations} migrations)"
        assert moved.final.usage.completion_tokens == TOKENS
    migrated = sum(o.migrations for o in disturbed)
    assert migrated > 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))
    schema = compiler.compile_json_schema(json.dumps(STRUCTURED_SCHEMA), any_whitespace=False)
    for moved in [disturbed[i] for i in CONSTRAINED]:
        matcher = xgr.GrammarMatcher(schema)
        assert all(matcher.accept_token(t) for t in moved.token_ids), f"request {moved.index} left its schema"
    assert sum(disturbed[i].migrations for i in CONSTRAINED) > 0  # a constrained stream continued elsewhere
    by_reason = metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason")
    assert sum(by_reason.values()) - before == migrated, by_reason
    _all_serving(supervised)  # the supervisor started it again; no block stays reserved, used or pinned


def test_redis_restarted_under_load_no_request_fails(supervised: Supervised, redis_server: RedisServer) -> None:
    """Redis restart: Redis stopped and started again while image and text requests stream: 0 failed, and no
    worker taken for gone."""
    cluster = supervised.cluster
    _all_serving(supervised)

    def make(i: int):
        return image_request(20_000 + i, 24) if i % 2 else text_request(i, 24)

    def vanished() -> float:
        return metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason").get("vanished", 0)

    vanished_before = vanished()
    with Load([cluster.address], make, clients=4) as load:
        time.sleep(2)
        redis_server.stop()
        time.sleep(3)
        redis_server.start()
        time.sleep(3)
    assert len(load.outcomes) >= 8 and not load.failures(), describe(load.failures())
    assert vanished() == vanished_before  # an empty registry after the restart is not a worker gone
    _all_serving(supervised)


def _serving_worker(redis_url: str, exclude: str = "") -> str:
    """The one worker publishing a running request (only one request runs), other than `exclude`."""
    registry = Registry(redis_url)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            busy = [m.address for m in registry.members("worker") or [] if m.state["running"] and m.address != exclude]
            if busy:
                return busy[0]
            time.sleep(0.05)
    finally:
        registry.close()
    raise AssertionError(f"no worker other than {exclude!r} ever ran the request")


def test_migrations_past_the_limit_end_with_unavailable_naming_worker_and_count(supervised: Supervised) -> None:
    """Migration limit: with EPD_MIGRATION_LIMIT=1, the worker serving a long request is killed, the request moves
    once, then its new worker is killed too: UNAVAILABLE naming that worker and the count."""
    cluster = supervised.cluster
    _all_serving(supervised)
    by_address = {p.address: p for p in cluster.workers}
    _, stub = balanced_stub([supervised.limited.address])
    first_chunk, chunks = threading.Event(), []

    def on_chunk(index: int) -> None:
        chunks.append(index)
        first_chunk.set()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_one, stub, 0, text_request(7, 3000), 120.0, on_chunk)
        assert first_chunk.wait(120)
        first = _serving_worker(cluster.redis_url)
        os.kill(by_address[first].popen.pid, signal.SIGKILL)
        second = _serving_worker(cluster.redis_url, exclude=first)
        os.kill(by_address[second].popen.pid, signal.SIGKILL)
        outcome = running.result()
    assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details, len(outcome.token_ids))
    assert f"worker {second} failed" in outcome.details and "moved 1 time(s)" in outcome.details, outcome.details
    assert "EPD_MIGRATION_LIMIT" in outcome.details and len(outcome.token_ids) > 0
    _all_serving(supervised)


def test_a_hung_worker_is_left_when_it_vanishes_from_the_registry(supervised: Supervised) -> None:
    """A worker frozen mid-stream (SIGSTOP: its connection stays open, its heartbeat stops) drops out of the
    registry; the router migrates its request (reason `vanished`) and the output is unchanged. The worker frozen is
    the one publishing the request as running, so the calm run must have left the registry first; 1500 tokens, so
    the stream still runs when the worker is frozen, however slow the box makes finding it."""
    cluster = supervised.cluster
    _all_serving(supervised)
    (calm,) = run_all([cluster.address], [image_request(3, 1500, salt="calm-hung")])
    assert calm.ok and len(calm.token_ids) == 1500
    settled_workers(cluster.redis_url, 2)  # the calm run's worker no longer publishes it running: not taken for busy
    before = metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason").get("vanished", 0)
    _, stub = balanced_stub([cluster.address])
    first_chunk = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            stream_one, stub, 0, image_request(3, 1500, salt="hung"), 120.0, lambda index: first_chunk.set()
        )
        assert first_chunk.wait(120)
        frozen = next(p for p in cluster.workers if p.address == _serving_worker(cluster.redis_url))
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        try:
            outcome = running.result()
        finally:
            os.kill(frozen.popen.pid, signal.SIGCONT)
    assert outcome.ok, (outcome.code, outcome.details)
    assert outcome.token_ids == calm.token_ids and outcome.migrations >= 1
    after = metric_by_label(cluster.router.metrics_port, "epd_migrations_total", "reason").get("vanished", 0)
    assert after - before >= 1
    _all_serving(supervised)
