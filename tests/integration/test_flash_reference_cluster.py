"""The GPU's attention path through the whole cluster on the CPU: `EPD_ATTENTION_BACKEND=flash-reference` with
256-token blocks (the flash backend's), as `epd up` starts it; greedy answers equal `generate`, the workers
publish their backend and block size, and the router hashes prefixes with that size (a repeated prompt
longer than a block is served from the prefix cache)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.client import Client, user_request
from services.common.registry import Registry
from services.launch.local import LocalCluster
from tests import media_factory
from tests.integration.conftest import RedisServer, model_folder, module_cluster
from tests.integration.test_skeleton import MAX_TOKENS, PROMPT, expected


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    env = {"EPD_ATTENTION_BACKEND": "flash-reference", "EPD_BLOCK_SIZE": "256"}
    yield from module_cluster(model_dir, redis_server, tmp_path_factory, env=env)


def test_answers_equal_generate_and_state_is_published(
    cluster: LocalCluster, model_dir: Path, redis_server: RedisServer
) -> None:
    (member,) = Registry(redis_server.url).members("worker")
    assert member.state["attention_backend"] == "flash-reference" and member.state["block_size"] == 256
    client = Client(cluster.address)
    try:
        for images, prompt in [
            ([media_factory.jpeg(1400, 1100, seed=1)], PROMPT),  # above max_pixels: more than one block of image
            ([media_factory.png(64, 96, seed=5), media_factory.jpeg(150, 80, seed=6)], "Compare them."),
            ([], "Hello there"),
        ]:
            answer = client.generate(user_request(prompt, images, max_tokens=MAX_TOKENS))
            assert answer.token_ids == expected(model_dir, images, prompt), prompt
        again = client.generate(user_request(PROMPT, [media_factory.jpeg(1400, 1100, seed=1)], max_tokens=MAX_TOKENS))
        assert again.final.usage.cached_tokens >= 256  # whole 256-token blocks came from the prefix cache
    finally:
        client.close()
