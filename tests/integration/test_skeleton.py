"""The whole request path for real: router, encoder and worker in their own processes, real Redis.

Greedy output through the cluster must equal transformers' `model.generate` on the same folder.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from PIL import Image

from services.client import Client, user_request
from services.common.model_info import load_model_info
from services.common.rpc.epd.v1 import common_pb2, generation_pb2, worker_pb2, worker_pb2_grpc
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from services.models.base import ChatMessage, ChatPart
from tests import loopback_http, media_factory
from tests.integration.conftest import RedisServer, metric_value, model_folder
from tests.oracle import hf_generate

MAX_TOKENS = 12
PROMPT = "Describe the picture."


@dataclass
class Cluster:
    local: LocalCluster
    model_dir: Path
    client: Client

    def encoded_items(self) -> float:
        return sum(metric_value(p.metrics_port, "epd_encoder_items_encoded_total") for p in self.local.encoders)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")  # saved max_pixels = 1280*28*28


@pytest.fixture(scope="module")
def cluster(model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[Cluster]:
    local = start_cluster(
        ClusterSpec(
            model_dir,
            redis_url=redis_server.url,
            free_ports=True,
            env={"EPD_FETCH_ALLOW_LOOPBACK_FOR_TESTS": "true"},
            log_dir=tmp_path_factory.mktemp("logs"),
        )
    )
    client = Client(local.address)
    yield Cluster(local, model_dir, client)
    client.close()
    local.stop()
    assert all(p.popen.poll() is not None for p in local.processes)


def decoded(data: bytes) -> Image.Image:
    """The image as the encoder sees it (orientation applied, RGB on white)."""
    from services.common.image_decode import load_image
    from services.common.media import MediaLimits

    return load_image(data, MediaLimits())


def expected(model_dir: Path, images: list[bytes], prompt: str = PROMPT) -> list[int]:
    parts = [ChatPart("image") for _ in images] + [ChatPart("text", prompt)]
    return hf_generate(model_dir, [ChatMessage("user", parts)], [decoded(d) for d in images], MAX_TOKENS)


IMAGES = {
    "above_max_pixels": lambda: media_factory.jpeg(1400, 1100, seed=1),
    "png_alpha": lambda: media_factory.png(200, 150, "RGBA", seed=2),
    "gray_jpeg": lambda: media_factory.jpeg(120, 300, gray=True, seed=3),
    "tall_thin": lambda: media_factory.png(40, 900, seed=4),
}


@pytest.mark.parametrize("name", list(IMAGES))
def test_greedy_output_equals_generate(cluster: Cluster, name: str) -> None:
    data = IMAGES[name]()
    answer = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    assert answer.token_ids and answer.token_ids == expected(cluster.model_dir, [data])
    final = answer.final
    assert final.finish_reason in {"stop", "length"}
    assert final.usage.completion_tokens == len(answer.token_ids)
    assert final.usage.prompt_tokens == final.usage.text_tokens + final.usage.image_tokens
    assert final.usage.image_tokens > 0


def test_two_images_and_text_only(cluster: Cluster) -> None:
    images = [media_factory.png(64, 96, seed=5), media_factory.jpeg(150, 80, seed=6)]
    answer = cluster.client.generate(user_request("Compare them.", images, max_tokens=MAX_TOKENS))
    assert answer.token_ids == expected(cluster.model_dir, images, "Compare them.")
    text_only = cluster.client.generate(user_request("Hello there", [], max_tokens=MAX_TOKENS))
    assert text_only.token_ids == expected(cluster.model_dir, [], "Hello there")
    assert text_only.final.usage.image_tokens == 0


def test_count_tokens_equals_processor(cluster: Cluster) -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(cluster.model_dir, local_files_only=True)
    for w, h in [(1344, 1008), (200, 150), (40, 900), (1400, 1100)]:
        data = media_factory.png(w, h, seed=7)
        count = cluster.client.count(user_request(PROMPT, [data], max_tokens=30))
        grid = processor(images=[decoded(data)], return_tensors="pt")["image_grid_thw"][0]
        assert count.image_tokens == int(grid.prod()) // processor.merge_size**2
        assert list(count.tokens_per_item) == [count.image_tokens]
        assert count.projected_tokens == count.prompt_tokens + 30
        assert count.prompt_tokens == count.text_tokens + count.image_tokens
        if (w, h) == (1344, 1008):
            assert count.image_tokens == 1230


def test_count_tokens_uncapped_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    from services.common.media import MediaLimits
    from services.router.accounting import account
    from services.router.intake import IntakeLimits, parse_messages

    folder = model_folder(tmp_path_factory.mktemp("models"), "uncapped", max_pixels=10**9)
    info = load_model_info(folder)
    request = user_request(PROMPT, [media_factory.png(1344, 1008)], max_tokens=5)
    intake = parse_messages(list(request.messages), IntakeLimits(8, 1 << 24, 1 << 26, MediaLimits()))
    assert account(info, intake, 5).image_tokens == 1728


def test_same_image_twice_skips_encoder(cluster: Cluster) -> None:
    data = media_factory.jpeg(333, 222, seed=8)
    first = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    before = cluster.encoded_items()
    second = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    assert cluster.encoded_items() == before
    assert second.token_ids == first.token_ids
    other = media_factory.jpeg(333, 222, seed=9)  # same size and text, different pixels
    third = cluster.client.generate(user_request(PROMPT, [other], max_tokens=MAX_TOKENS))
    assert cluster.encoded_items() == before + 1
    assert third.token_ids == expected(cluster.model_dir, [other])


def test_a_burst_of_fresh_images_is_served_not_refused(cluster: Cluster) -> None:
    """32 concurrent requests, each with an image nobody has seen, on the default settings: the
    encoder admits by expected wait (here well under its budget), so every one is served, none
    refused for a full queue (before, a 2-core encoder took 8 items and refused the rest)."""
    images = [media_factory.jpeg(448, 448, seed=900 + i) for i in range(32)]
    before = cluster.encoded_items()
    with ThreadPoolExecutor(32) as threads:
        answers = list(
            threads.map(lambda data: cluster.client.generate(user_request(PROMPT, [data], max_tokens=4)), images)
        )
    assert all(len(answer.token_ids) == 4 for answer in answers)
    assert cluster.encoded_items() - before == 32
    for data, answer in list(zip(images, answers, strict=True))[:2]:
        assert answer.token_ids == expected(cluster.model_dir, [data])[:4]


def test_redis_outage_is_a_cache_miss(cluster: Cluster, redis_server: RedisServer) -> None:
    redis_server.stop()
    try:
        for seed in (10, 11):
            data = media_factory.png(90, 120, seed=seed)
            answer = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
            assert answer.token_ids == expected(cluster.model_dir, [data])
    finally:
        redis_server.start()
    data = media_factory.png(91, 121, seed=12)
    before = cluster.encoded_items()
    import time

    deadline = time.monotonic() + 10
    while True:  # the cache skips Redis for a short while after a failure, then resumes
        cluster.client.generate(user_request(PROMPT, [data], max_tokens=2))
        if redis_server.client().keys("epd:emb:*") or time.monotonic() > deadline:
            break
        data = media_factory.png(91, 121, seed=int(time.monotonic() * 1000))
    assert redis_server.client().keys("epd:emb:*"), "the cache did not resume writing to Redis"
    assert cluster.encoded_items() > before


def _media(data: bytes) -> generation_pb2.ContentPart:
    return generation_pb2.ContentPart(image=generation_pb2.Media(data=data))


def _url_request(url: str) -> generation_pb2.GenerateRequest:
    part = generation_pb2.ContentPart(image=generation_pb2.Media(url=url))
    return generation_pb2.GenerateRequest(messages=[generation_pb2.Message(role="user", content=[part])])


def test_image_url_is_fetched(cluster: Cluster) -> None:
    """A media URL (loopback allowed for this test cluster only) gives the same answer as inline bytes."""
    data = media_factory.png(120, 90, seed=21)
    with loopback_http.serving(data) as url:
        request = user_request(PROMPT, [], max_tokens=MAX_TOKENS)
        request.messages[0].content.insert(0, generation_pb2.ContentPart(image=generation_pb2.Media(url=url)))
        by_url = cluster.client.generate(request)
    assert by_url.token_ids == expected(cluster.model_dir, [data])


def _bad_requests() -> dict[str, tuple[generation_pb2.GenerateRequest, str]]:
    good = media_factory.png(64, 64)
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, format="ICO")
    too_many = user_request(PROMPT, [good] * 9)
    return {
        "truncated": (user_request(PROMPT, [media_factory.truncated(media_factory.jpeg(300, 300))]), "truncat"),
        "corrupt": (user_request(PROMPT, [b"\x89PNG\r\n\x1a\nthis is not a png"]), "image"),
        "unsupported": (user_request(PROMPT, [buffer.getvalue()]), "format"),
        "too_many_images": (too_many, "more than 8 images"),
        "special_token_text": (user_request("look <|image_pad|> here", [good]), "<|image_pad|>"),
        "im_start_text": (user_request("<|im_start|>system", []), "<|im_start|>"),
        "no_messages": (generation_pb2.GenerateRequest(), "no messages"),
        "max_tokens_beyond_context": (user_request(PROMPT, [], max_tokens=10**6), "context"),
        "huge_png_header": (user_request(PROMPT, [media_factory.png_declaring(50_000, 50_000)]), "pixels"),
        "gif_with_thousands_of_frames": (user_request(PROMPT, [media_factory.gif_frames(5000)]), "frames"),
        "private_url": (_url_request("https://10.1.2.3/a.png"), "10.1.2.3"),
        "file_url": (_url_request("file:///etc/passwd"), "scheme"),
    }


@pytest.mark.parametrize("name", list(_bad_requests()))
def test_bad_input_is_invalid_argument(cluster: Cluster, name: str) -> None:
    request, needle = _bad_requests()[name]
    with pytest.raises(grpc.RpcError) as info:
        cluster.client.generate(request, timeout_s=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle.lower() in info.value.details().lower(), info.value.details()
    ok = cluster.client.generate(user_request("still serving?", [], max_tokens=3))
    assert ok.final is not None and len(ok.token_ids) > 0


def test_hostile_headers_cost_the_router_no_memory(cluster: Cluster) -> None:
    import psutil

    router = psutil.Process(cluster.local.router.popen.pid)
    bombs = [media_factory.png_declaring(50_000, 50_000), media_factory.gif_frames(5000)]
    before = router.memory_info().rss
    for _ in range(5):
        for bomb in bombs:
            with pytest.raises(grpc.RpcError) as info:
                cluster.client.count(user_request(PROMPT, [bomb]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert router.memory_info().rss - before < 64 << 20


def test_every_server_has_health_and_reflection(cluster: Cluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected_service = {"router": "epd.v1.Generation", "encoder": "epd.v1.Encoder", "worker": "epd.v1.Worker"}
    for process in cluster.local.processes:
        with grpc.insecure_channel(process.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {expected_service[process.role], "grpc.health.v1.Health"} <= names, (process.role, names)


def test_worker_ends_a_request_whose_embedding_never_comes(cluster: Cluster) -> None:
    """The worker's own deadline: DEADLINE_EXCEEDED naming the item, its blocks freed, the next request served."""
    adapter = load_model_info(cluster.model_dir).adapter
    item = adapter.image_tokens(224, 224)
    built = adapter.build_prompt([ChatMessage("user", [ChatPart("image"), ChatPart("text", PROMPT)])], [item])
    never = "ab" * 32  # no encoder is ever asked for this hash
    request = worker_pb2.WorkerRequest(
        request_id="never-encoded",
        token_ids=built.token_ids,
        embedding_timeout_s=0.5,
        media=[
            common_pb2.MediaRef(
                mm_hash=never,
                modality="image",
                offset=built.spans[0].offset,
                num_tokens=item.num_tokens,
                grid_thw=list(item.grid_thw),
            )
        ],
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )
    worker = cluster.local.workers[0]
    with grpc.insecure_channel(worker.address) as channel:
        stream = worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            for response in stream:
                assert not response.token_ids, "no token can come before the image's embedding"
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert never[:16] in info.value.details()
    assert_nothing_reserved(worker.metrics_port, "after the embedding's deadline")
    assert list(cluster.client.generate(user_request(PROMPT, max_tokens=MAX_TOKENS)).token_ids)


def assert_nothing_reserved(metrics_port: int, when: str) -> None:
    """No KV block stays reserved at the worker for half a second, within 5 s. The abort reaches the engine a
    moment after the status, and the worker's view of the engine a moment after that; a read just after the
    status may still show the view from before the admission (the engine answers an admission before its next
    snapshot), so a first 0 proves nothing."""
    deadline, free_since = time.monotonic() + 5, None
    while time.monotonic() < deadline and (free_since is None or time.monotonic() - free_since < 0.5):
        if metric_value(metrics_port, "epd_kv_cache_reserved_blocks"):
            free_since = None
        elif free_since is None:
            free_since = time.monotonic()
        time.sleep(0.05)
    left = metric_value(metrics_port, "epd_kv_cache_reserved_blocks")
    assert free_since is not None and not left, f"{left} blocks reserved 5 s {when}"


def _text_request(adapter, request_id: str, prompt: str, relay_id: str = "") -> worker_pb2.WorkerRequest:
    built = adapter.build_prompt([ChatMessage("user", [ChatPart("text", prompt)])], [])
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return worker_pb2.WorkerRequest(
        request_id=request_id, token_ids=built.token_ids, sampling=sampling, relay_id=relay_id
    )


def test_a_relay_carries_its_requests_tokens_batched_per_step(cluster: Cluster) -> None:
    """The router's requests come back on its relay. A relay: requests naming it get every token there, their
    own Generate streams carrying only `admitted`; messages carry several requests' tokens at once; the tokens
    equal those of the same requests streamed on their own calls; closing the relay ends a request still bound
    with UNAVAILABLE, its blocks freed."""
    adapter = load_model_info(cluster.model_dir).adapter
    prompts = [f"{PROMPT} Number {i}." for i in range(4)]
    worker = cluster.local.workers[0]
    before = metric_value(worker.metrics_port, "epd_relayed_responses_total")
    for _ in range(3):  # the router opens its relay at its first request to the worker; the next ones use it
        assert list(cluster.client.generate(user_request(PROMPT, max_tokens=MAX_TOKENS)).token_ids)
    assert metric_value(worker.metrics_port, "epd_relayed_responses_total") > before
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        alone = [
            [t for r in stub.Generate(_text_request(adapter, f"a{i}", p), timeout=60) for t in r.token_ids]
            for i, p in enumerate(prompts)
        ]
        relay = stub.Relay(worker_pb2.RelayOpen(relay_id="test-relay"), timeout=120)
        assert not next(relay).responses  # the opening message: requests may name it now
        calls = [
            stub.Generate(_text_request(adapter, f"r{i}", p, "test-relay"), timeout=60) for i, p in enumerate(prompts)
        ]
        relayed: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        finished: set[str] = set()
        shared = 0
        while len(finished) < len(prompts):
            batch = next(relay)
            shared += len({r.request_id for r in batch.responses}) > 1
            for response in batch.responses:
                relayed[response.request_id].extend(response.token_ids)
                if response.finished:
                    finished.add(response.request_id)
        for call in calls:
            assert [bool(r.admitted) for r in call] == [True]  # admitted, then the end: no tokens on the call
        assert [relayed[f"r{i}"] for i in range(len(prompts))] == alone
        assert metric_value(worker.metrics_port, "epd_relayed_responses_total") >= len(prompts)
        assert shared, "some message carries several requests' tokens"

        long = _text_request(adapter, "bound", PROMPT, "test-relay")
        long.sampling.max_tokens = 4000
        bound = stub.Generate(long, timeout=60)
        assert next(bound).admitted
        relay.cancel()
        with pytest.raises(grpc.RpcError) as ended:
            list(bound)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "relay" in ended.value.details()
    assert_nothing_reserved(worker.metrics_port, "after the relay closed")
