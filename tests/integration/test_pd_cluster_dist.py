"""Prefill/decode disaggregation through the whole cluster with the torch.distributed KV transport
(`EPD_KV_TRANSPORT=dist`: gRPC's `PushKV` carries each chunk's header and first token, the bytes go over the gloo
pair the prefill worker keeps with its decode worker): router, encoder, one decode and one prefill worker, real
Redis, the tiny Qwen2-VL, as test_pd_cluster.py starts them (a second router with the threshold 0 is the
co-located reference). Proven here: concurrent requests of text and one to three images above the threshold, and
one below it, equal transformers' greedy `generate` and the co-located answers; every KV byte the prefill worker
sent went over the pair and arrived (none came by gRPC); nothing is held on either worker afterwards. The
transport's failures are proven in tests/unit/test_kv_transport_dist.py; the rest of the P/D proofs (gRPC) in
test_pd_cluster.py."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.client import Client
from tests import media_factory
from tests.integration import test_pd_cluster as pd_cluster
from tests.integration.conftest import RedisServer, model_folder
from tests.integration.test_pd_cluster import LONG, PD, THRESHOLD, Ask, _all_free, _answer, _wait_pushes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")


@pytest.fixture(scope="module")
def pd(model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    yield from pd_cluster.start_pd(model_dir, redis_server, tmp_path_factory, {"EPD_KV_TRANSPORT": "dist"})


def _kv_bytes(port: int, direction: str, transport: str) -> float:
    """The KV bytes a worker counted in ``direction`` by ``transport`` (its `epd_kv_transfer_bytes`)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    labels = (f'direction="{direction}"', f'transport="{transport}"')
    lines = [line for line in text.splitlines() if line.startswith("epd_kv_transfer_bytes")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if all(label in line for label in labels))


def test_mixed_requests_over_the_dist_transport_equal_generate_and_colocated(pd: PD) -> None:
    small, wide = media_factory.png(56, 56, seed=1), media_factory.jpeg(168, 112, seed=2)
    big = media_factory.png(224, 224, seed=3)
    asks = [
        Ask("story: " + LONG * 3),
        Ask("one: " + LONG * 2 + "what next?", (small,)),
        Ask("two: " + LONG * 2 + "what next?", (wide, small)),
        Ask("three: " + LONG * 2 + "what next?", (big, wide, small)),
        Ask("short one?"),
    ]
    with Client(pd.local.address) as split, Client(pd.colocated.address) as colocated:
        lengths = [split.count(ask.request()).prompt_tokens for ask in asks]
        above = sum(n >= THRESHOLD for n in lengths)
        assert above == 4 and lengths[-1] < THRESHOLD, lengths
        before = pd.pushes()
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda ask: _answer(split, ask.request())[0], asks))
        assert _wait_pushes(pd, before + above) == before + above  # each long one went to the prefill worker
        reference = [_answer(colocated, ask.request(cache_salt="colocated"))[0] for ask in asks]
    for i, ask in enumerate(asks):
        assert got[i] == ask.expected(pd.model_dir), (i, lengths[i])
        assert reference[i] == got[i], i
    sent = _kv_bytes(pd.prefill.metrics_port, "sent", "dist")
    assert sent > 0
    assert _kv_bytes(pd.prefill.metrics_port, "sent", "grpc") == 0
    assert _kv_bytes(pd.decode.metrics_port, "received", "dist") == sent  # every byte over the pair, none by gRPC
    assert _kv_bytes(pd.decode.metrics_port, "received", "grpc") == 0
    _all_free(pd)
