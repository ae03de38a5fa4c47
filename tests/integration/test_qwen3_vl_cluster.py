"""The whole request path on the tiny Qwen3-VL: greedy answers, CountTokens and the embedding cache, with DeepStack.

Router, encoder and two workers in their own processes, real Redis; one cluster per transport (the encoder pushes
by gRPC, then by torch.distributed over gloo), each shared by the module's tests. Each image's embedding carries its
two DeepStack levels end to end (encoder, transport, Redis and in-process caches, the worker's prefill). Greedy
answers with one to three images, and text alone, equal transformers' `generate`; CountTokens equals the image
processor's count; a repeated image is served from the embedding cache (the encoder does not run again) as one
entry holding every level, with the same answer; an entry a Qwen2-VL model of the same hidden size wrote for the
same bytes is never read; a video alone and beside an image (its frame groups between timestamps) equals
`generate` given the model's own video preprocessing, CountTokens equals the processor's count of a stored video
including the timestamps, and a repeated video is served from the cache; and when a worker is killed mid-stream
under 8 image requests every request completes on the other, re-prefilled with its image's levels from the cache,
token for token as before (the module's last test: the killed worker stays down)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from services.client import Client, user_request
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.model_info import load_model_info
from services.common.rpc.epd.v1 import generation_pb2
from services.launch.local import LocalCluster
from services.models import deepstack
from services.models.base import ChatMessage, ChatPart
from services.models.registry import load_adapter
from tests import media_factory
from tests.integration.conftest import RedisServer, metric_value, module_cluster
from tests.oracle import hf_generate
from tests.oracle_video import hf_generate_media, video_config, video_inputs
from tests.reliability_support import StreamsStarted, describe, image_request, run_all

MAX_TOKENS = 12
VIDEO_REFERENCE = Path(__file__).resolve().parents[1] / "data" / "video_reference"
VIDEO_CASES = json.loads((VIDEO_REFERENCE / "reference.json").read_text())
PROMPT = "Describe the picture."
TRANSPORTS = ["grpc", "dist"]


@dataclass
class Cluster:
    local: LocalCluster
    transport: str
    seed: int  # each cluster's images differ: the module's Redis outlives the first cluster
    model_dir: Path
    redis: RedisServer
    client: Client

    def encoded_items(self) -> float:
        return sum(metric_value(p.metrics_port, "epd_encoder_items_encoded_total") for p in self.local.encoders)

    def router_cache_hits(self) -> float:
        return metric_value(self.local.router.metrics_port, "epd_embedding_cache_hits_total")

    def transports_used(self) -> str:
        import urllib.request

        return "".join(
            urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=5).read().decode()
            for p in self.local.encoders
        )


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(
    request: pytest.FixtureRequest,
    tiny_qwen3_vl_dir: Path,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    env = {"EPD_EMBEDDING_TRANSPORT": request.param}
    for local in module_cluster(tiny_qwen3_vl_dir, redis_server, tmp_path_factory, workers=2, env=env):
        client = Client(local.address)
        yield Cluster(local, request.param, 100 * TRANSPORTS.index(request.param), tiny_qwen3_vl_dir, redis_server,
                      client)  # fmt: skip
        client.close()


def decoded(data: bytes) -> Image.Image:
    """The image as the encoder sees it (orientation applied, RGB on white)."""
    from services.common.image_decode import load_image
    from services.common.media import MediaLimits

    return load_image(data, MediaLimits())


def expected(model_dir: Path, images: list[bytes], prompt: str = PROMPT) -> list[int]:
    parts = [ChatPart("image") for _ in images] + [ChatPart("text", prompt)]
    return hf_generate(model_dir, [ChatMessage("user", parts)], [decoded(d) for d in images], MAX_TOKENS)


def _tokens(model_dir: Path, data: bytes) -> int:
    """The image processor's own token count for the decoded image (grid product over the 2x2 merge)."""
    adapter = load_adapter(model_dir)
    grid = adapter.image_processor(images=[decoded(data)], return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // adapter.image_processor.merge_size**2


def test_one_to_three_images_and_text_equal_generate(cluster: Cluster) -> None:
    s = cluster.seed
    cases = [
        ("Describe the picture.", [media_factory.jpeg(640, 480, seed=s + 1)]),
        ("Compare them.", [media_factory.png(64, 96, seed=s + 2), media_factory.png(300, 120, "RGBA", seed=s + 3)]),
        (
            "Which is largest?",
            [
                media_factory.jpeg(200, 150, seed=s + 4),
                media_factory.png(90, 300, seed=s + 5),
                media_factory.jpeg(448, 448, seed=s + 6),
            ],
        ),  # fmt: skip
        ("Hello there, who are you?", []),
    ]
    before = cluster.encoded_items()
    for prompt, images in cases:
        answer = cluster.client.generate(user_request(prompt, images, max_tokens=MAX_TOKENS))
        assert answer.token_ids and answer.token_ids == expected(cluster.model_dir, images, prompt), prompt
        assert answer.final.usage.image_tokens == sum(_tokens(cluster.model_dir, d) for d in images)
    assert cluster.encoded_items() == before + 6
    assert f'transport="{cluster.transport}"' in cluster.transports_used()


def test_count_tokens_equals_the_processor(cluster: Cluster) -> None:
    for w, h in [(1344, 1008), (200, 150), (40, 900), (32, 32), (3000, 20)]:
        data = media_factory.png(w, h, seed=7)
        count = cluster.client.count(user_request(PROMPT, [data], max_tokens=30))
        assert list(count.tokens_per_item) == [_tokens(cluster.model_dir, data)], (w, h)
        assert count.prompt_tokens == count.text_tokens + count.image_tokens
        assert count.projected_tokens == count.prompt_tokens + 30


def _entries(cluster: Cluster) -> set[bytes]:
    revision = load_model_info(cluster.model_dir).identity.revision
    return set(cluster.redis.client().scan_iter(match=f"epd:emb:{revision}:*"))


def test_repeated_image_is_served_from_the_cache_with_every_level(cluster: Cluster) -> None:
    data = media_factory.jpeg(333, 222, seed=cluster.seed + 10)
    entries = _entries(cluster)
    first = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    (key,) = _entries(cluster) - entries  # one entry for the image, all its levels in it
    before, hits = cluster.encoded_items(), cluster.router_cache_hits()
    second = cluster.client.generate(user_request("What colour is it?", [data], max_tokens=MAX_TOKENS))
    assert cluster.encoded_items() == before  # the encoder did not run again
    assert cluster.router_cache_hits() == hits + 1
    assert first.token_ids == expected(cluster.model_dir, [data])
    assert second.token_ids == expected(cluster.model_dir, [data], "What colour is it?")

    info = load_model_info(cluster.model_dir)
    cache = EmbeddingCache(CacheSettings(cluster.redis.url, info.identity.revision))
    stored = cache.get(key.decode().rsplit(":", 1)[1]).tensor
    cache.close()
    adapter = info.adapter
    model = adapter.load_model()
    alone = adapter.encode(model, [adapter.preprocess(decoded(data))])[0]
    assert stored is not None and stored.shape == alone.shape == (first.final.usage.image_tokens, 3 * 64)
    assert torch.allclose(stored, alone, atol=1e-5, rtol=0)
    for level in range(adapter.deepstack_levels):
        assert deepstack.level_rows(stored, 64, level).abs().sum() > 0


def test_a_qwen2_vl_entry_of_the_same_width_is_never_read(cluster: Cluster, tiny_model_dir: Path) -> None:
    """A Qwen2-VL model of the same hidden size (64) sharing the Redis writes its embedding of the same bytes; the
    Qwen3-VL cluster's item goes by another key, so it encodes its own (with its levels) and answers as generate."""
    qwen2 = load_model_info(tiny_model_dir)
    assert qwen2.adapter.hidden_size == 64 and qwen2.adapter.embedding_width == 64
    data = media_factory.jpeg(260, 180, seed=cluster.seed + 20)
    from services.common.hashing import mm_hash

    theirs_hash = mm_hash(qwen2.identity, "image", data)
    theirs = qwen2.adapter.encode(qwen2.adapter.load_model(), [qwen2.adapter.preprocess(decoded(data))])[0]
    cache = EmbeddingCache(CacheSettings(cluster.redis.url, qwen2.identity.revision))
    assert cache.put(theirs_hash, theirs)
    cache.close()
    ours = load_model_info(cluster.model_dir).identity
    assert mm_hash(ours, "image", data) != theirs_hash and ours.revision != qwen2.identity.revision
    before, hits = cluster.encoded_items(), cluster.router_cache_hits()
    answer = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    assert cluster.encoded_items() == before + 1 and cluster.router_cache_hits() == hits
    assert answer.token_ids == expected(cluster.model_dir, [data])


def _media_request(
    parts: list[str | tuple[str, bytes]], max_tokens: int = MAX_TOKENS
) -> generation_pb2.GenerateRequest:
    """One user message of text and ("image" | "video", bytes) parts."""
    part, media = generation_pb2.ContentPart, generation_pb2.Media
    content = [part(text=p) if isinstance(p, str) else part(**{p[0]: media(data=p[1])}) for p in parts]
    request = user_request("", [], max_tokens=max_tokens)
    del request.messages[0].content[:]
    request.messages[0].content.extend(content)
    return request


def _video_expected(model_dir: Path, parts: list[str | tuple[str, bytes]]) -> list[int]:
    """`generate` given the model's own video preprocessing (tests/oracle_video.py) for the same message."""
    chat = [ChatPart("text", p) if isinstance(p, str) else ChatPart(p[0]) for p in parts]
    media = [p[1] if p[0] == "video" else decoded(p[1]) for p in parts if not isinstance(p, str)]
    return hf_generate_media(model_dir, [ChatMessage("user", chat)], media, MAX_TOKENS)


def test_video_alone_and_with_an_image_equals_generate(cluster: Cluster) -> None:
    """A video's frame groups, with the timestamps between them, through encoder (one item, its DeepStack levels),
    transport, cache and worker (one span per group): greedy output equals `generate`; usage counts its tokens as
    the processor does; the same video again is served from the embedding cache."""
    s = cluster.seed
    video = media_factory.video(97, 61, seconds=2, fps=15, seed=s + 21)
    webm = media_factory.video(64, 48, seconds=1.5, fps=8, container="webm", seed=s + 23)
    cases = [
        [("video", video), "What happens in the video?"],
        [("image", media_factory.png(90, 60, seed=s + 22)), "then", ("video", webm), "Which moves?"],
    ]
    before = cluster.encoded_items()
    for parts in cases:
        answer = cluster.client.generate(_media_request(parts))
        assert answer.token_ids and answer.token_ids == _video_expected(cluster.model_dir, parts)
        usage = answer.final.usage
        videos = [video_inputs(p[1], video_config(cluster.model_dir)) for p in parts if p[0] == "video"]
        assert usage.video_tokens == sum(int(np.prod(v.video_grid_thw)) // 4 for v in videos)
        assert usage.prompt_tokens == usage.text_tokens + usage.image_tokens + usage.video_tokens
    assert cluster.encoded_items() == before + 3
    again = cluster.client.generate(_media_request(cases[0]))
    assert cluster.encoded_items() == before + 3 and again.token_ids == _video_expected(cluster.model_dir, cases[0])


@pytest.mark.parametrize("name", ["mp4_97x61_15fps_2s", "webm_121x67_24fps_2s", "mp4_58x40_25fps_20s"])
def test_video_count_tokens_equals_the_processor(cluster: Cluster, name: str) -> None:
    """CountTokens on a stored video equals the count of the prompt transformers' Qwen3VLProcessor built for it
    (tests/data/video_reference: timestamps and every frame group's vision_start/vision_end included)."""
    entry = VIDEO_CASES["videos"][name]
    reference = entry["qwen3-vl"]
    data = (VIDEO_REFERENCE / entry["file"]).read_bytes()
    count = cluster.client.count(_media_request([("video", data), "What happens in the video?"], max_tokens=30))
    t, h, w = reference["video_grid_thw"]
    assert count.prompt_tokens == len(reference["input_ids"])
    assert (count.video_tokens, list(count.tokens_per_item)) == (t * h * w // 4, [t * h * w // 4])
    assert (
        count.text_tokens == count.prompt_tokens - count.video_tokens
        and count.projected_tokens == count.prompt_tokens + 30
    )


def test_a_worker_killed_mid_stream_every_request_completes_unchanged(cluster: Cluster) -> None:
    """8 concurrent greedy image requests (eos ignored), kill -9 of a worker once every stream has tokens: each
    request moved to the other worker (prompt and tokens so far prefilled again there, the image's main rows and
    levels fetched from the cache) ends with the undisturbed run's tokens."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    streams, tokens, s = 8, 160, cluster.seed
    calm = run_all([cluster.local.address], [image_request(s + i, tokens, "calm", size=200) for i in range(streams)])
    assert all(o.ok and len(o.token_ids) == tokens for o in calm), describe([o for o in calm if not o.ok])
    on_chunk = StreamsStarted(streams)

    requests = [image_request(s + i, tokens, "disturbed", size=200) for i in range(streams)]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, [cluster.local.address], requests, 120.0, on_chunk)
        on_chunk.wait(120)
        os.kill(cluster.local.workers[0].popen.pid, signal.SIGKILL)
        disturbed = running.result()
    assert all(o.ok for o in disturbed), describe([o for o in disturbed if not o.ok])
    for quiet, moved in zip(calm, disturbed, strict=True):
        assert moved.token_ids == quiet.token_ids, f"request {moved.index} ({moved.migrations} migrations)"
    assert sum(o.migrations for o in disturbed) > 0
