"""The dashboard, the alert rules and docs/deploy.md name metrics a live cluster really exports.

One tiny cluster (router, encoder, worker on free ports, a private Redis) serves an image request,
the same image again (a cache hit), a CountTokens call, a request no worker could ever hold (an
admission rejection) and a refused media URL; then the three Prometheus endpoints are scraped and
every `epd_*` name used elsewhere must be on them, every family has HELP text, every `epd_*` sample
a `model_name` label and none an `otel_scope_*` label.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.client import Client, user_request
from services.common.rpc.epd.v1 import generation_pb2
from services.common.telemetry import SECONDS_BUCKETS
from services.launch.local import ClusterSpec, free_port, start_cluster
from tests import media_factory
from tests.deploy.test_observability import DASHBOARD, DEPLOY_DOC, METRIC, RULES
from tests.integration.conftest import RedisServer

# 128 KV blocks of the tiny model: a short request fits, max_tokens=4000 never can.
SMALL_KV = {"EPD_KV_CACHE_BYTES": str(1 << 20)}


@pytest.fixture(scope="module")
def scrapes(tiny_model_dir: Path) -> Iterator[dict[str, str]]:
    """Each role's /metrics text after the requests above."""
    redis = RedisServer(free_port())
    redis.start()
    cluster = start_cluster(ClusterSpec(tiny_model_dir, free_ports=True, redis_url=redis.url, env=SMALL_KV))
    try:
        send_requests(cluster.address)
        yield {
            p.role: urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=10).read().decode()
            for p in cluster.processes
        }
    finally:
        cluster.stop()
        redis.stop()


def send_requests(address: str) -> None:
    image = media_factory.png(160, 120)
    with Client(address) as client:
        # 16 tokens, eos ignored: the worker coalesces tokens made while a message is in flight, so a
        # 4-token answer from a fast engine can come as one message, and the router then has no gap to record
        # as inter-token latency (its histogram is not exported until it has a sample)
        streamed = user_request("Describe the image.", [image], max_tokens=16)
        streamed.sampling.ignore_eos = True
        answer = client.generate(streamed, timeout_s=120)
        assert len(answer.token_ids) == 16 and answer.final.usage.image_tokens > 0
        again = client.generate(user_request("Describe it again.", [image], max_tokens=2), timeout_s=120)
        assert again.final.usage.image_tokens > 0  # the same image: an embedding cache hit (hits by tier)
        assert client.count(user_request("Count me.", [image])).image_tokens > 0
        with pytest.raises(grpc.RpcError) as never_fits:
            client.generate(user_request("Describe the image.", [image], max_tokens=4000), timeout_s=60)
        assert never_fits.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        by_url = user_request("Describe the image.", max_tokens=4)
        by_url.messages[0].content.insert(
            0, generation_pb2.ContentPart(image=generation_pb2.Media(url="http://127.0.0.1:1/cat.png"))
        )
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(by_url, timeout_s=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def exported(text: str) -> set[str]:
    """Sample names (`x_bucket`, `x_total`, ...) and family names (`# TYPE x ...`) on an endpoint."""
    names = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, flags=re.MULTILINE))
    return names


def documented_sources() -> dict[str, set[str]]:
    """docs/deploy.md metrics table: name -> the services it says export it."""
    rows = re.findall(r"^\|\s*`(epd_[a-z0-9_]+)`\s*\|[^|]*\|([^|]*)\|", DEPLOY_DOC.read_text(), flags=re.MULTILINE)
    return {name: {s.strip() for s in sources.split(",")} for name, sources in rows}


def test_dashboard_and_rules_use_exported_metrics(scrapes: dict[str, str]) -> None:
    live = set().union(*(exported(text) for text in scrapes.values()))
    for path in (DASHBOARD, RULES):
        used = set(METRIC.findall(path.read_text()))
        assert used, path
        assert sorted(used - live) == [], f"{path.name} uses metrics no service exports"


def test_documented_metrics_come_from_the_services_named(scrapes: dict[str, str]) -> None:
    documented = documented_sources()
    assert len(documented) >= 15
    for name, sources in documented.items():
        for source in sources:
            assert name in exported(scrapes[source]), f"docs/deploy.md: {name} is not exported by the {source}"


def test_second_histograms_use_the_telemetry_buckets(scrapes: dict[str, str]) -> None:
    bounds = re.findall(r'^epd_time_to_first_token_seconds_bucket\{le="([^"]+)"', scrapes["router"], flags=re.MULTILINE)
    assert [float(b) for b in bounds if b != "+Inf"] == list(SECONDS_BUCKETS)
    assert re.search(r'^epd_request_prefill_time_seconds_bucket\{le="0.001"', scrapes["worker"], flags=re.MULTILINE)
    assert re.search(r'^epd_encoder_time_seconds_bucket\{le="120.0"', scrapes["encoder"], flags=re.MULTILINE)


def test_every_metric_has_help(scrapes: dict[str, str]) -> None:
    for role, text in scrapes.items():
        families = re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE)
        helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, flags=re.MULTILINE))
        assert any(f.startswith("epd_") for f in families), role
        assert [f for f in families if not helps.get(f, "").strip()] == [], f"{role}: families without HELP"


def test_samples_carry_model_name_and_no_scope_labels(scrapes: dict[str, str], tiny_model_dir: Path) -> None:
    for role, text in scrapes.items():
        assert "otel_scope_" not in text, role
        samples = re.findall(r"^(epd_[a-z0-9_]+)(\{[^}]*\})? ", text, flags=re.MULTILINE)
        assert samples, role
        unlabelled = {name for name, labels in samples if f'model_name="{tiny_model_dir.resolve().name}"' not in labels}
        assert unlabelled == set(), f"{role}: samples without model_name"


def test_preemptions_are_a_counter_and_count_tokens_is_counted(scrapes: dict[str, str]) -> None:
    assert re.search(r"^# TYPE epd_num_preemptions_total counter$", scrapes["worker"], flags=re.MULTILINE)
    assert re.search(r'^epd_num_preemptions_total\{model_name="[^"]+"\} 0\.0$', scrapes["worker"], flags=re.MULTILINE)
    counted = r'^epd_count_tokens_requests_total\{.*outcome="ok".*\} 1\.0$'
    assert re.search(counted, scrapes["router"], flags=re.MULTILINE)
