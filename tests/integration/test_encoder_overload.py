"""Bursts of fresh images against an encoder's limits, through the whole cluster (router, encoder, worker in their
own processes, real Redis).

A burst past the encoder's count ceiling (one preprocessing slot) is held at the router and served, none
refused; a backlog past the encoder's time budget is refused with RESOURCE_EXHAUSTED and a retry hint, mostly
by the router itself before any worker or encoder call; either way nothing is held afterwards: no KV blocks
reserved, no encoder admissions, slots or queued tower items, no request in flight at the router. How fast a
refusal comes is measured by `epd bench serve --request-rate` (docs/encoder.md), not here.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from PIL import Image

from services.client import Client, user_request
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from tests.bench.leak_check import metric_by_label, wait_until_idle
from tests.integration.conftest import RedisServer, metric_value

MAX_TOKENS = 4


@dataclass
class Outcome:
    tokens: int = 0
    code: grpc.StatusCode | None = None
    details: str = ""
    retry_after_ms: str | None = None


def _image(i: int) -> bytes:
    """A fresh 1600x1200 PNG per index: a few kilobytes to send, tens of milliseconds to decode."""
    buffer = io.BytesIO()
    Image.new("RGB", (1600, 1200), (i % 256, (i * 7) % 256, 90)).save(buffer, "PNG")
    return buffer.getvalue()


def _burst(cluster: LocalCluster, first: int, count: int) -> list[Outcome]:
    """`count` requests at once, each with an image nobody sent before."""

    def one(i: int) -> Outcome:
        request = user_request(f"image {i}", [_image(i)], max_tokens=MAX_TOKENS)
        request.sampling.ignore_eos = True
        with Client(cluster.address) as client:
            try:
                answer = client.generate(request, 120)
                return Outcome(tokens=len(answer.token_ids))
            except grpc.RpcError as exc:
                trailing = dict(exc.trailing_metadata() or ())
                return Outcome(code=exc.code(), details=exc.details(), retry_after_ms=trailing.get("retry-after-ms"))

    with ThreadPoolExecutor(count) as threads:
        return list(threads.map(one, range(first, first + count)))


def _assert_nothing_held(cluster: LocalCluster) -> None:
    idle = wait_until_idle(cluster.redis_url, cluster.router.metrics_port, timeout_s=60)
    assert idle["leaked"] == {}, idle
    assert idle["state"]["workers"] == 1 and idle["state"]["encoders"] == 1, idle


def _encoder_refusals(cluster: LocalCluster) -> float:
    return metric_by_label(cluster.encoders[0].metrics_port, "epd_encoder_rejections_total", "reason").get(
        "overloaded", 0.0
    )


def _cluster(model_dir: Path, redis_server: RedisServer, db: int, logs: Path, env: dict) -> Iterator[LocalCluster]:
    """A cluster on database `db` of the module's Redis: its own registry, so its router sees only its own
    encoder and worker (both clusters of this module run at once)."""
    url = redis_server.url.rsplit("/", 1)[0] + f"/{db}"
    local = start_cluster(ClusterSpec(model_dir, redis_url=url, free_ports=True, log_dir=logs, env=env))
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def ceiling(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[LocalCluster]:
    """One decode process and one preprocessing slot: the count ceiling binds long before the 20 s budget."""
    env = {"EPD_PREPROCESS_WORKERS": "1", "EPD_PREPROCESS_QUEUE": "1", "EPD_ADMISSION_MAX_WAIT_S": "60"}
    yield from _cluster(tiny_model_dir, redis_server, 1, tmp_path_factory.mktemp("logs"), env)


def test_a_burst_past_the_encoders_count_ceiling_is_queued_not_refused(ceiling: LocalCluster) -> None:
    outcomes = _burst(ceiling, 0, 8)
    assert [o.code for o in outcomes] == [None] * 8, [o.details for o in outcomes if o.code]
    assert all(o.tokens == MAX_TOKENS for o in outcomes)
    assert _encoder_refusals(ceiling) >= 1  # the ceiling did bind ('full'): the router held and retried
    assert metric_value(ceiling.router.metrics_port, "epd_admission_rejections_total") == 0
    _assert_nothing_held(ceiling)


@pytest.fixture(scope="module")
def budget(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[LocalCluster]:
    """A time budget of 1 ms: any image arriving while another is encoding is past it."""
    env = {"EPD_ENCODER_MAX_QUEUE_S": "0.001"}
    yield from _cluster(tiny_model_dir, redis_server, 2, tmp_path_factory.mktemp("logs"), env)


def test_a_backlog_past_the_encoders_budget_is_refused_and_nothing_leaks(budget: LocalCluster) -> None:
    outcomes = _burst(budget, 100, 8)
    served = [o for o in outcomes if o.code is None]
    refused = [o for o in outcomes if o.code is not None]
    assert served and refused, [o.code for o in outcomes]
    assert all(o.tokens == MAX_TOKENS for o in served)
    for o in refused:
        assert o.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "every encoder is busy" in o.details, o.details
        assert o.retry_after_ms is not None and int(o.retry_after_ms) >= 20
    reasons = metric_by_label(budget.router.metrics_port, "epd_admission_rejections_total", "reason")
    assert sum(reasons.values()) == len(refused) and set(reasons) <= {"encoders_busy", "encoder_backlog"}, reasons
    assert reasons.get("encoders_busy", 0) >= 1  # judged at the router: no worker reserved, no bytes sent
    _assert_nothing_held(budget)
    after = _burst(budget, 200, 1)  # and the encoder serves again once its backlog is gone
    assert after[0].code is None and after[0].tokens == MAX_TOKENS
    _assert_nothing_held(budget)
