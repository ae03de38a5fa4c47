"""The engine on the tiny LLaVA-1.5: 16 concurrent mixed requests each equal `generate` for that request alone.

576 tokens per image, 1-D positions, a Llama language model. Requests are text only or carry one to three
images; each gives exactly transformers' greedy `generate` for it alone, as tests/unit/test_engine_exactness.py
proves for Qwen2-VL, with the same cases: token budgets 16, 64 and 512 (an image's 576 rows spread over many
steps), prefix caching on and off, the decode kernel, SDPA, and `flash-reference` at 16-token blocks and at
256-token blocks through the decode graphs' padded path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models.registry import load_adapter
from services.worker.engine.attention.backend import ATTENTION_NAME
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingOptions
from tests.engine_support import Prompt, Result, build_prompt, collect, drain, image, reference

LONG = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm window " * 3


@pytest.fixture(scope="module")
def llava_loaded(tiny_llava_dir: Path) -> Iterator[tuple[Any, Any]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    adapter = load_adapter(tiny_llava_dir)
    yield adapter, adapter.load_model()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workload(llava_loaded: tuple[Any, Any], tiny_llava_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    """16 prompts of different shapes, their max_tokens, and the reference completions."""
    adapter, model = llava_loaded
    big, small, tall = image(448, 448, 1), image(56, 56, 2), image(90, 300, 3)
    wide, mid, other = image(300, 200, 4), image(224, 224, 5), image(448, 448, 6)
    parts: list[list[Any]] = [
        ["hi"],
        [LONG],
        [small, "what is this?"],
        [big, "describe the picture in detail"],
        [big, "describe the picture briefly"],  # shares the prefix with the one above, image included
        [other, "describe the picture in detail"],  # same text, different image
        [tall, wide, "compare these two"],
        [mid, small, big, "three images: which is largest?"],
        ["before the image " + LONG, wide, "and after it"],
        [LONG + " once more", mid],
        ["short question?"],
        [small, small, "twice the same image"],
        [LONG, tall, LONG],
        ["count to ten"],
        [wide, "what colour dominates here, and why do you think so?"],
        [mid, "a", big, "b", tall, "c"],
    ]
    out = []
    for i, p in enumerate(parts):
        prompt = build_prompt(adapter, model, p)
        assert all(m.num_tokens == 576 for m in prompt.media)
        max_tokens = 6 + (i * 5) % 23
        out.append((prompt, max_tokens, reference(tiny_llava_dir, prompt, max_tokens)))
    assert len({tuple(expected) for _, _, expected in out}) == len(out)  # the model tells every request apart
    return out


BACKENDS = {
    "kernel": ("cpu-kernel", 16, "off"),
    "sdpa": ("sdpa", 16, "off"),
    "flashref16": ("flash-reference", 16, "off"),
    "flashref256-graphs": ("flash-reference", 256, "eager"),  # decode-only steps padded as the GPU graphs are
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_concurrent_greedy_equals_generate(
    llava_loaded: tuple[Any, Any],
    workload: list[tuple[Prompt, int, list[int]]],
    budget: int,
    caching: bool,
    backend: str,
) -> None:
    adapter, model = llava_loaded
    name, block_size, graphs = BACKENDS[backend]
    config = EngineConfig(
        kv_cache_bytes=16 << 20,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        enable_prefix_caching=caching,
        attention_backend=name,
        cuda_graphs=graphs,
        max_model_len=4096,
    )
    engine = Engine(adapter, model, config)
    assert (engine.config.attention_backend, engine.config.block_size) == (name, block_size)
    assert model.config.text_config._attn_implementation == ATTENTION_NAME  # the Llama's layers are paged
    assert model.config.vision_config._attn_implementation != ATTENTION_NAME
    results: dict[str, Result] = {}
    late: list[Prompt] = []
    for i, (prompt, max_tokens, _) in enumerate(workload):
        if i % 2:  # half the embeddings arrive before their request, half a few steps after
            for mm_hash, tensor in prompt.embeddings.items():
                engine.provide_embedding(mm_hash, tensor)
        else:
            late.append(prompt)
        engine.add_request(prompt.request(f"r{i}", SamplingOptions(max_tokens=max_tokens)))
        if i % 4 == 3:  # arrivals in groups of four, a step apart
            collect(engine.step(), results)
            for prompt in late:
                for mm_hash, tensor in prompt.embeddings.items():
                    engine.provide_embedding(mm_hash, tensor)
            late.clear()
    drain(engine, results)
    for i, (_, max_tokens, expected) in enumerate(workload):
        got = results[f"r{i}"]
        assert got.tokens == expected, f"request {i} (max_tokens {max_tokens})"
        assert got.finish_reason == ("length" if len(expected) == max_tokens else "stop")
    state = engine.kv_state()
    assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0
    assert engine.embedding_stats().pinned == 0
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.steps > 0  # decode-only steps went through the padded graph path
    if caching and block_size == 16:  # requests 3 and 4 share an image prefix: served from cache
        assert any(r.cached_tokens >= 576 for r in results.values())
