"""The whole request path on the tiny LLaVA-1.5 folder: greedy answers, CountTokens and the embedding cache.

Router, encoder and worker in their own processes, real Redis. Greedy answers with one and two images equal
transformers' `generate`; CountTokens gives 576 per image whatever its size; a repeated image is served from the
embedding cache (the encoder does not run again)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from services.client import Client, user_request
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from services.models.base import ChatMessage, ChatPart
from tests import media_factory
from tests.integration.conftest import RedisServer, metric_value
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

    def router_cache_hits(self) -> float:
        return metric_value(self.local.router.metrics_port, "epd_embedding_cache_hits_total")


@pytest.fixture(scope="module")
def cluster(tiny_llava_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[Cluster]:
    local = start_cluster(
        ClusterSpec(
            tiny_llava_dir, redis_url=redis_server.url, free_ports=True, log_dir=tmp_path_factory.mktemp("logs")
        )
    )
    client = Client(local.address)
    yield Cluster(local, tiny_llava_dir, client)
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


def test_one_and_two_images_equal_generate(cluster: Cluster) -> None:
    one = [media_factory.jpeg(640, 480, seed=1)]
    answer = cluster.client.generate(user_request(PROMPT, one, max_tokens=MAX_TOKENS))
    assert answer.token_ids and answer.token_ids == expected(cluster.model_dir, one)
    assert answer.final.usage.image_tokens == 576
    assert answer.final.usage.prompt_tokens == answer.final.usage.text_tokens + 576
    two = [media_factory.png(64, 96, seed=2), media_factory.png(300, 120, "RGBA", seed=3)]
    answer = cluster.client.generate(user_request("Compare them.", two, max_tokens=MAX_TOKENS))
    assert answer.token_ids == expected(cluster.model_dir, two, "Compare them.")
    assert answer.final.usage.image_tokens == 2 * 576
    # The streamed text (incremental detokenization with Llama's byte-fallback decoder) is the whole decode.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cluster.model_dir)
    assert answer.text == tokenizer.decode(answer.token_ids, skip_special_tokens=True)
    text_only = cluster.client.generate(user_request("Hello there", [], max_tokens=MAX_TOKENS))
    assert text_only.token_ids == expected(cluster.model_dir, [], "Hello there")


def test_count_tokens_is_576_per_image(cluster: Cluster) -> None:
    for w, h in [(1344, 1008), (200, 150), (40, 900), (336, 336)]:
        count = cluster.client.count(user_request(PROMPT, [media_factory.png(w, h, seed=7)], max_tokens=30))
        assert count.image_tokens == 576 and list(count.tokens_per_item) == [576]
        assert count.prompt_tokens == count.text_tokens + 576 and count.projected_tokens == count.prompt_tokens + 30
    images = [media_factory.png(50, 60, seed=8), media_factory.jpeg(900, 40, seed=9), media_factory.png(8, 8)]
    count = cluster.client.count(user_request(PROMPT, images, max_tokens=1))
    assert list(count.tokens_per_item) == [576] * 3 and count.image_tokens == 3 * 576


def test_repeated_image_is_served_from_the_cache(cluster: Cluster) -> None:
    data = media_factory.jpeg(333, 222, seed=10)
    first = cluster.client.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    before, hits = cluster.encoded_items(), cluster.router_cache_hits()
    second = cluster.client.generate(user_request("What colour is it?", [data], max_tokens=MAX_TOKENS))
    assert cluster.encoded_items() == before  # the encoder did not run again
    assert cluster.router_cache_hits() == hits + 1
    assert first.token_ids == expected(cluster.model_dir, [data])
    assert second.token_ids == expected(cluster.model_dir, [data], "What colour is it?")
    other = media_factory.jpeg(333, 222, seed=11)  # same size, different pixels: encoded
    third = cluster.client.generate(user_request(PROMPT, [other], max_tokens=MAX_TOKENS))
    assert cluster.encoded_items() == before + 1
    assert third.token_ids == expected(cluster.model_dir, [other])
