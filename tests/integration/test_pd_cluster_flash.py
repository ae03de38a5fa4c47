"""Prefill/decode disaggregation through the whole cluster on the GPU's attention path on the CPU
(`EPD_ATTENTION_BACKEND=flash-reference`, 256-token blocks, the pool in the flash backend's layout, which is the
wire layout): 16 concurrent requests of text and one to three images through router, encoder, one decode and one
prefill worker equal transformers' greedy `generate` and the co-located answers (a second router, threshold 0,
on the same workers), each long one prefilled remotely and no short one; seeded sampling and logprobs equal the
co-located answers; nothing held afterwards. The rest of the proofs run at 16-token blocks in test_pd_cluster.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.registry import Registry
from tests.integration import test_pd_cluster as pd_cluster
from tests.integration.conftest import RedisServer, model_folder
from tests.integration.test_pd_cluster import PD

test_mixed_concurrent_requests_equal_generate_and_colocated = (
    pd_cluster.test_mixed_concurrent_requests_equal_generate_and_colocated
)
test_seeded_sampling_and_logprobs_equal_colocated = pd_cluster.test_seeded_sampling_and_logprobs_equal_colocated


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")


@pytest.fixture(scope="module")
def pd(model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    env = {"EPD_ATTENTION_BACKEND": "flash-reference", "EPD_BLOCK_SIZE": "256"}
    for started in pd_cluster.start_pd(model_dir, redis_server, tmp_path_factory, env):
        registry = Registry(redis_server.url)
        states = [m.state for role in ("worker", "prefill") for m in registry.members(role) or []]
        registry.close()
        assert [(s["block_size"], s["attention_backend"]) for s in states] == [(256, "flash-reference")] * 2
        yield started
