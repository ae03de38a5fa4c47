"""Video through a real cluster (router, encoder and worker in their own processes, real Redis), per family.

Greedy output equals transformers' `generate` given the model's own video preprocessing (tests/oracle_video.py,
proven equal to transformers' video processor in tests/unit/test_qwen2_vl_video.py); CountTokens equals the
tokens that preprocessing makes; mixed and repeated prompts hit the embedding and prefix caches; hostile
videos are refused fast with no worker blocks held.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from services.client import Client
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from services.models.base import ChatMessage, ChatPart
from tests import media_factory
from tests.integration.conftest import RedisServer, metric_value, model_folder
from tests.oracle_video import hf_generate_media, video_config, video_inputs

MAX_TOKENS = 10
PROMPT = "What happens in the video?"
MAX_FRAME_PIXELS = 2_000_000
MAX_SECONDS = 30


@dataclass
class Cluster:
    local: LocalCluster
    model_dir: Path
    client: Client

    def encoded_items(self) -> float:
        return sum(metric_value(p.metrics_port, "epd_encoder_items_encoded_total") for p in self.local.encoders)

    def reserved_blocks(self) -> float:
        return sum(metric_value(w.metrics_port, "epd_kv_cache_reserved_blocks") for w in self.local.workers)


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def cluster(request, redis_server: RedisServer, tmp_path_factory) -> Iterator[Cluster]:
    model_dir = model_folder(tmp_path_factory.mktemp("models"), request.param, request.param)
    env = {
        "EPD_MAX_VIDEO_FRAME_PIXELS": str(MAX_FRAME_PIXELS),
        "EPD_MAX_VIDEO_SECONDS": str(MAX_SECONDS),
        "EPD_MAX_ITEM_BYTES": str(8 << 20),
        # deadlines only a hang misses: a module's first video encode took over 60 s on a box at load 13
        "EPD_ENCODE_TIMEOUT_S": "300",
        "EPD_EMBEDDING_TIMEOUT_S": "300",
    }
    spec = ClusterSpec(
        model_dir, redis_url=redis_server.url, free_ports=True, env=env, log_dir=tmp_path_factory.mktemp("logs")
    )
    local = start_cluster(spec)
    client = Client(local.address)
    yield Cluster(local, model_dir, client)
    client.close()
    local.stop()


def media_part(kind: str, data: bytes) -> generation_pb2.ContentPart:
    return generation_pb2.ContentPart(**{kind: generation_pb2.Media(data=data)})


def request(
    turns: list[tuple[str, list[tuple[str, bytes] | str]]], max_tokens: int = MAX_TOKENS
) -> generation_pb2.GenerateRequest:
    """A conversation: (role, parts) turns, a part being text or (kind, bytes)."""
    messages = [
        generation_pb2.Message(
            role=role,
            content=[generation_pb2.ContentPart(text=p) if isinstance(p, str) else media_part(*p) for p in parts],
        )
        for role, parts in turns
    ]
    return generation_pb2.GenerateRequest(messages=messages, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def expected(model_dir: Path, turns, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The oracle's answer for the same conversation (images as the encoder decodes them: RGB PNGs here)."""
    messages, media = [], []
    for role, parts in turns:
        chat = []
        for part in parts:
            if isinstance(part, str):
                chat.append(ChatPart("text", part))
                continue
            kind, data = part
            chat.append(ChatPart(kind))
            media.append(data if kind == "video" else Image.open(__import__("io").BytesIO(data)).convert("RGB"))
        messages.append(ChatMessage(role, chat))
    return hf_generate_media(model_dir, messages, media, max_tokens)


VIDEOS = {
    "mp4_97x61_15fps_2s": lambda: media_factory.video(97, 61, seconds=2, fps=15, seed=1),
    "webm_121x67_24fps_3s": lambda: media_factory.video(121, 67, seconds=3, fps=24, container="webm", seed=2),
    "mp4_mpeg4_75x133_10fps_1s": lambda: media_factory.video(75, 133, seconds=1, fps=10, codec="mpeg4", seed=3),
    "mkv_vp8_64x48_30fps_5s": lambda: media_factory.video(64, 48, seconds=5, fps=30, container="mkv", seed=4),
    "mp4_58x40_60fps_20s": lambda: media_factory.video(58, 40, seconds=20, fps=60, seed=5),
}


@pytest.mark.parametrize("name", list(VIDEOS))
def test_greedy_output_equals_generate(cluster: Cluster, name: str) -> None:
    video = VIDEOS[name]()
    turns = [("user", [("video", video), PROMPT])]
    answer = cluster.client.generate(request(turns))
    assert answer.token_ids and answer.token_ids == expected(cluster.model_dir, turns)
    usage = answer.final.usage
    grid = video_inputs(video, video_config(cluster.model_dir)).video_grid_thw
    assert usage.video_tokens == int(np.prod(grid)) // 4 and usage.image_tokens == 0
    assert usage.prompt_tokens == usage.text_tokens + usage.video_tokens
    count = cluster.client.count(request(turns))
    assert (count.video_tokens, list(count.tokens_per_item)) == (usage.video_tokens, [usage.video_tokens])
    assert count.prompt_tokens == usage.prompt_tokens == count.text_tokens + count.video_tokens


def test_mixed_prompt_and_repeat_hit_both_caches(cluster: Cluster) -> None:
    image = media_factory.png(90, 60, seed=11)
    video = media_factory.video(97, 61, seconds=3, fps=20, seed=12)
    first = [("user", [("image", image), "and", ("video", video), PROMPT])]
    answer = cluster.client.generate(request(first))
    assert answer.token_ids == expected(cluster.model_dir, first)
    assert answer.final.usage.image_tokens > 0 and answer.final.usage.video_tokens > 0
    encoded = cluster.encoded_items()
    reply = cluster.client.generate(request([("user", [("video", video), PROMPT])]))
    again = [*first, ("assistant", [answer.text or "ok"]), ("user", ["And then?"])]
    follow = cluster.client.generate(request(again))
    assert cluster.encoded_items() == encoded, "a repeated video or image went through the tower again"
    assert follow.final.usage.cached_tokens > 0 and follow.token_ids == expected(cluster.model_dir, again)
    assert reply.token_ids == expected(cluster.model_dir, [("user", [("video", video), PROMPT])])


def test_video_url_over_http_equals_grpc(cluster: Cluster) -> None:
    video = media_factory.video(80, 64, seconds=2, fps=12, container="webm", seed=13)
    url = f"data:video/webm;base64,{base64.b64encode(video).decode()}"
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": PROMPT}],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{cluster.local.http_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    grpc_answer = cluster.client.generate(request([("user", [("video", video), PROMPT])]))
    assert response.json()["usage"]["video_tokens"] == grpc_answer.final.usage.video_tokens > 0
    assert response.json()["choices"][0]["message"]["content"] == grpc_answer.text


def _hostile() -> dict[str, tuple[bytes, str]]:
    real = media_factory.video(96, 60, seconds=1, fps=10)
    return {
        "audio_only": (media_factory.audio_only(), "no video stream"),
        "an_image": (media_factory.png(64, 64), "not a video container"),
        "text": (b"this is not a video at all" * 20, "not a video container"),
        "garbage_after_ftyp": (real[:32] + bytes(range(256)) * 20, "corrupt"),
        "header_cut_short": (real[:200], "corrupt"),
        "ebml_garbage": (b"\x1a\x45\xdf\xa3" + bytes(range(256)) * 20, "corrupt"),
        "claims_a_million_frames": (media_factory.mp4_declaring_frames(real, 10**6), "samples"),
        "claims_twenty_million_frames": (media_factory.mp4_declaring_frames(real, 2 * 10**7), "samples"),
        "frames_too_large": (media_factory.video(1920, 1080, seconds=0.2, fps=10, codec="mpeg4"), "pixel"),
        "too_long": (media_factory.video(16, 16, seconds=MAX_SECONDS + 2, fps=1, codec="mpeg4"), "lasts"),
        "one_frame": (media_factory.video(64, 64, seconds=0.1, fps=10), "at least 2 frames"),
    }


def test_hostile_videos_are_refused_from_the_header_fast(cluster: Cluster) -> None:
    encoded = cluster.encoded_items()
    timings = {}
    for name, (data, needle) in _hostile().items():
        turns = [("user", [("video", data), PROMPT])]
        for call in (cluster.client.count, cluster.client.generate):
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                call(request(turns))
            elapsed = time.perf_counter() - start
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value.details())
            assert needle.lower() in info.value.details().lower(), (name, info.value.details())
            timings[name] = max(timings.get(name, 0.0), elapsed)
    print("refusal seconds:", {k: round(v, 4) for k, v in timings.items()})
    assert max(timings.values()) < 0.1, timings
    assert cluster.encoded_items() == encoded and cluster.reserved_blocks() == 0
    two = [
        ("user", [("video", media_factory.video(32, 32, seconds=1)), ("video", media_factory.video(32, 32)), PROMPT])
    ]
    with pytest.raises(grpc.RpcError, match="more than 1 videos"):
        cluster.client.count(request(two))


def test_a_header_that_lies_is_refused_by_the_encoder(cluster: Cluster) -> None:
    """An MP4 claiming 40 frames that holds 10: the router counts 40, the encoder finds the stream ends early,
    refuses (INVALID_ARGUMENT) rather than inventing frames, and the worker's reservation is given back."""
    liar = media_factory.mp4_declaring_frames(media_factory.video(96, 60, seconds=1, fps=10, seed=21), 40)
    with pytest.raises(grpc.RpcError) as info:
        cluster.client.generate(request([("user", [("video", liar), PROMPT])]), timeout_s=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "video 0" in info.value.details()
    deadline = time.monotonic() + 5
    while cluster.reserved_blocks() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.reserved_blocks() == 0
    assert cluster.client.generate(request([("user", ["still serving?"])], max_tokens=3)).token_ids
