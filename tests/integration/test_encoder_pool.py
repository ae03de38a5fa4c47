"""The encoder pool for real: 2 encoders and 2 workers in their own processes, real Redis, gloo pushes.

One cluster per module (torch.distributed transport, a batch window wide enough to catch
concurrent items), plus one extra encoder with a tiny preprocessing queue for the overload test.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from services.client import Client, user_request
from services.common import overload
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.grpc_server import channel_options
from services.common.media import MediaLimits
from services.common.model_info import ModelInfo, load_model_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import encoder_pb2, encoder_pb2_grpc
from services.launch.health import wait_healthy
from services.launch.local import ClusterSpec, LocalCluster, free_port, start_cluster
from services.router.accounting import account
from services.router.intake import IntakeLimits, parse_messages
from tests import media_factory
from tests.integration.conftest import RedisServer, metric_value, model_folder
from tests.oracle import hf_generate

MAX_TOKENS = 12
PROMPT = "Describe the picture."
SIZES = [(64, 64), (200, 150), (40, 300), (333, 222), (128, 96), (90, 120), (500, 60), (224, 224)]


@dataclass
class Pool:
    local: LocalCluster
    model_dir: Path
    info: ModelInfo
    client: Client
    redis_url: str

    def total(self, name: str) -> float:
        return sum(metric_value(p.metrics_port, name) for p in self.local.encoders)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")


@pytest.fixture(scope="module")
def pool(model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[Pool]:
    env = {
        "EPD_EMBEDDING_TRANSPORT": "dist",
        "EPD_MAX_BATCH_WAIT_MS": "300",
        "EPD_PREPROCESS_WORKERS": "1",
        "EPD_PREPROCESS_QUEUE": "32",
    }
    local = start_cluster(
        ClusterSpec(
            model_dir,
            encoders=2,
            workers=2,
            redis_url=redis_server.url,
            free_ports=True,
            env=env,
            log_dir=tmp_path_factory.mktemp("logs"),
        )
    )
    client = Client(local.address)
    yield Pool(local, model_dir, load_model_info(model_dir), client, redis_server.url)
    client.close()
    local.stop()
    assert all(p.popen.poll() is not None for p in local.processes)


def decoded(data: bytes):
    """The image as the encoder sees it (orientation applied, RGB)."""
    from services.common.image_decode import load_image

    return load_image(data, MediaLimits())


def expected(model_dir: Path, data: bytes) -> list[int]:
    from services.models.base import ChatMessage, ChatPart

    message = ChatMessage("user", [ChatPart("image"), ChatPart("text", PROMPT)])
    return hf_generate(model_dir, [message], [decoded(data)], MAX_TOKENS)


def encode_request(info: ModelInfo, images: list[bytes], destination: str = "") -> encoder_pb2.EncodeRequest:
    """What the router sends an encoder for these images (refs from the router's own accounting)."""
    request = user_request(PROMPT, images, max_tokens=MAX_TOKENS)
    limits = IntakeLimits(len(images), 1 << 26, 1 << 28, MediaLimits())
    accounted = account(info, parse_messages(list(request.messages), limits), MAX_TOKENS)
    items = [
        encoder_pb2.EncodeItem(ref=ref, data=data)
        for ref, data in zip(accounted.refs, accounted.item_data, strict=True)
    ]
    return encoder_pb2.EncodeRequest(request_id=uuid.uuid4().hex, items=items, destination=destination, deadline_s=60)


def _images(seed: int, count: int = 8) -> list[bytes]:
    out = []
    for i, (w, h) in enumerate(SIZES[:count]):
        maker = media_factory.png if i % 2 else media_factory.jpeg
        out.append(maker(w, h, seed=seed + i))
    return out


def test_eight_images_batched_equal_each_alone_and_outputs_equal_generate(pool: Pool) -> None:
    from services.models.vision_runner import VisionRunner

    images = _images(seed=100)
    encoder = pool.local.encoders[0]
    calls_before = metric_value(encoder.metrics_port, "epd_encoder_batch_size_count")
    items_before = metric_value(encoder.metrics_port, "epd_encoder_batch_size_sum")
    request = encode_request(pool.info, images)
    with grpc.insecure_channel(encoder.address, options=channel_options()) as channel:
        reply = encoder_pb2_grpc.EncoderStub(channel).Encode(request, timeout=120)
    assert (reply.encoded, reply.cached) == (8, 0)
    assert metric_value(encoder.metrics_port, "epd_encoder_batch_size_count") == calls_before + 1
    assert metric_value(encoder.metrics_port, "epd_encoder_batch_size_sum") == items_before + 8

    cache = EmbeddingCache(CacheSettings(pool.redis_url, pool.info.identity.revision))
    runner = VisionRunner(pool.info.adapter, pool.info.adapter.load_model())
    for item, data in zip(request.items, images, strict=True):
        batched = cache.get(item.ref.mm_hash).tensor
        alone = runner.encode([decoded(data)]).embeddings[0]
        assert batched is not None and batched.dtype == torch.float32 and batched.shape == alone.shape
        assert (batched - alone).abs().max().item() <= 1e-5
    cache.close()

    with ThreadPoolExecutor(8) as threads:  # the batched embeddings, served from the cache to both workers
        answers = list(
            threads.map(lambda data: pool.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS)), images)
        )
    for data, answer in zip(images, answers, strict=True):
        assert answer.token_ids == expected(pool.model_dir, data)


def test_32_concurrent_requests_over_8_images_encode_each_once(pool: Pool) -> None:
    images = _images(seed=200)
    answers_expected = [expected(pool.model_dir, data) for data in images]
    order = [i % 8 for i in range(32)]
    random.Random(0).shuffle(order)
    before = pool.total("epd_encoder_items_encoded_total")
    with ThreadPoolExecutor(32) as threads:
        answers = list(
            threads.map(lambda i: pool.client.generate(user_request(PROMPT, [images[i]], max_tokens=MAX_TOKENS)), order)
        )
    for i, answer in zip(order, answers, strict=True):
        assert answer.token_ids == answers_expected[i]
    assert pool.total("epd_encoder_items_encoded_total") - before == 8
    assert pool.total("epd_embedding_transfer_fallbacks_total") == 0
    text = "".join(_metrics_text(p.metrics_port) for p in pool.local.encoders)
    assert 'transport="dist"' in text and 'transport="grpc"' not in text


def test_inflight_lock_owner_waiters_renewal_expiry_and_outage(redis_server: RedisServer) -> None:
    from services.encoder.inflight_lock import InflightLocks

    def key(mm_hash: str) -> str:
        return f"epd:emb:test:{mm_hash}"

    mine = InflightLocks(redis_server.url, "test", key, ttl_s=0.5)
    theirs = InflightLocks(redis_server.url, "test", key, ttl_s=0.5)
    assert mine.acquire("a") and not theirs.acquire("a")
    assert theirs.peer_state("a").locked and not theirs.peer_state("a").cached
    theirs.release("a")  # not the owner: no effect
    assert not theirs.acquire("a")
    redis_server.client().set(key("a"), b"x")
    mine.release("a")
    assert theirs.peer_state("a") == type(theirs.peer_state("a"))(cached=True, locked=False)
    assert mine.acquire("b")
    time.sleep(1.2)  # a live owner renews its lock past the TTL (a long encode)
    assert theirs.peer_state("b").locked and not theirs.acquire("b")
    mine.close()  # the owner dies: its renewals stop and the lock expires by its TTL
    time.sleep(0.7)
    assert theirs.acquire("b")
    down = InflightLocks("redis://127.0.0.1:1/0", "test", key, socket_timeout_s=0.1, retry_after_s=5)
    start = time.perf_counter()
    assert down.acquire("c") and down.acquire("c")  # fail open; the second skips Redis
    assert not down.peer_state("c").locked
    down.release("c")
    assert time.perf_counter() - start < 1.0
    for locks in (mine, theirs, down):
        locks.close()


def _metrics_text(port: int) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_encoders_publish_their_load(pool: Pool) -> None:
    registry = Registry(pool.redis_url)
    members = registry.members("encoder", pool.info.identity.revision)
    registry.close()
    assert members is not None
    assert sorted(m.address for m in members) == sorted(p.address for p in pool.local.encoders)
    for member in members:
        assert {"queued_tokens", "queued_items", "preprocess_outstanding", "batch_queue_items"} <= set(member.state)


@dataclass
class SmallEncoder:
    address: str
    info: ModelInfo


@pytest.fixture(scope="module")
def small_encoder(redis_server: RedisServer, tmp_path_factory) -> Iterator[SmallEncoder]:
    """One more encoder, with one decode process and room for two items.

    Its model caps images at 256*28*28 pixels, so an accepted item costs the (CPU) tower little
    while big source images still take tens of milliseconds to decode and keep the queue full.
    """
    model_dir = model_folder(tmp_path_factory.mktemp("models"), "small-qwen2-vl", max_pixels=256 * 28 * 28)
    port = free_port()
    log_path = tmp_path_factory.mktemp("small-encoder") / "encoder.log"
    env = {
        **os.environ,
        "EPD_MODEL": str(model_dir),
        "EPD_REDIS_URL": redis_server.url,
        "EPD_HOST": "127.0.0.1",
        "EPD_PORT": str(port),
        "EPD_METRICS_PORT": "0",
        "EPD_PREPROCESS_WORKERS": "1",
        "EPD_PREPROCESS_QUEUE": "2",
        "EPD_MAX_BATCH_WAIT_MS": "1",
    }
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "encoder"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(f"127.0.0.1:{port}", 120, alive=lambda: popen.poll() is None)
        yield SmallEncoder(f"127.0.0.1:{port}", load_model_info(model_dir))
    finally:
        popen.terminate()
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def _flat_png(w: int, h: int, colour: tuple[int, int, int]) -> bytes:
    """A few kilobytes on the wire, tens of milliseconds to decode: holds the queue without a slow upload."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buffer, "PNG")
    return buffer.getvalue()


async def _wave(address: str, requests: list[encoder_pb2.EncodeRequest], gap_s: float) -> list[tuple[object, float]]:
    """Send `requests` open-loop, one every `gap_s`; (reply or error, seconds) for each."""

    async def call(stub: encoder_pb2_grpc.EncoderStub, request: encoder_pb2.EncodeRequest, delay_s: float):
        await asyncio.sleep(delay_s)
        start = time.perf_counter()
        try:
            return await stub.Encode(request, timeout=120), time.perf_counter() - start
        except grpc.aio.AioRpcError as exc:
            return exc, time.perf_counter() - start

    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)
        await stub.Encode(encoder_pb2.EncodeRequest(), timeout=30)  # connected and warm
        return await asyncio.gather(*(call(stub, r, gap_s * i) for i, r in enumerate(requests)))


def _check_wave(
    requests: list[encoder_pb2.EncodeRequest], results: list[tuple[object, float]], cache: EmbeddingCache
) -> None:
    """Strict checks of one overload wave: refusals are FULL with a hint, what got in was encoded."""
    refused = [(exc, s) for exc, s in results if isinstance(exc, grpc.aio.AioRpcError)]
    accepted = [
        (request, reply)
        for request, (reply, _) in zip(requests, results, strict=True)
        if not isinstance(reply, grpc.aio.AioRpcError)
    ]
    assert len(accepted) >= 2 and len(refused) >= 100, [type(r).__name__ for r, _ in results]
    for exc, _ in refused:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        assert "queue is full" in exc.details()
        hint, kind = overload.read(exc.trailing_metadata())
        assert hint > 0 and kind == overload.FULL  # a ceiling, not a backlog: a router may hold and retry
    for request, reply in accepted:
        assert reply.encoded == 1 and cache.contains([request.items[0].ref.mm_hash]) == [True]
    assert max(s for _, s in refused) < 30, "a refusal waited: it must never queue"


def test_a_full_preprocessing_queue_refuses_and_accepted_requests_complete(
    small_encoder: SmallEncoder, redis_server: RedisServer
) -> None:
    """Open-loop arrivals every 2 ms, far above what one decode process drains: the queue of two
    stays full, everything beyond it is refused (RESOURCE_EXHAUSTED, kind FULL, a retry hint), what
    got in completes. How fast a refusal comes is measured by `epd bench encoder`, not here."""
    cache = EmbeddingCache(CacheSettings(redis_server.url, small_encoder.info.identity.revision, max_bytes=0))
    images = [_flat_png(1600, 1200, (i % 256, 7, 160)) for i in range(150)]
    requests = [encode_request(small_encoder.info, [data]) for data in images]
    results = asyncio.run(_wave(small_encoder.address, requests, 0.002))
    _check_wave(requests, results, cache)
    cache.close()
