"""Acceptance 1: 16 concurrent requests (text only, and one to three images) through the engine give, each,
exactly transformers' greedy `generate` for that request alone; at token budgets 16, 64 and 512 (prefill is
chunked in the first two), with prefix caching on and off, arrivals and embeddings staggered; and under an
inter-token latency target (prefill chunks sized by measured step costs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingOptions
from tests.engine_support import Prompt, Result, build_prompt, collect, drain, image, reference

LONG = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm window " * 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def workload(loaded: tuple[Any, Any], tiny_model_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    """16 prompts of different shapes, their max_tokens, and the reference completions."""
    adapter, model = loaded
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
        max_tokens = 6 + (i * 5) % 23
        out.append((prompt, max_tokens, reference(tiny_model_dir, prompt, max_tokens)))
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
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]], budget: int, caching: bool, backend: str
) -> None:
    """Every CPU attention path: the compiled kernel (this machine has a C compiler), SDPA, and the GPU's
    varlen call with its pure-torch twin at 16- and 256-token blocks, the latter through the decode graphs'
    padded static-buffer path (eagerly: no capture on the CPU)."""
    adapter, model = loaded
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
    assert (engine.runner.graphs is not None) == (graphs == "eager")
    results = run_workload(engine, workload)
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.steps > 0  # decode-only steps went through the padded graph path
    if caching and block_size == 16:  # 256-token blocks: prefix reuse is tested in test_engine_requests.py
        assert any(r.cached_tokens > 0 for r in results.values())


@pytest.mark.parametrize("target_ms", [0.001, 3.0], ids=["minimum-chunks", "3ms"])
def test_concurrent_greedy_equals_generate_under_an_itl_target(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]], target_ms: float
) -> None:
    """With an inter-token latency target the prefill chunks next to decodes are sized by the measured step
    cost (0.001 ms: always the minimum, a block; 3 ms: whatever this machine's steps allow); still exact."""
    adapter, model = loaded
    config = EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=512, max_num_seqs=16, max_model_len=4096,
                          itl_target_ms=target_ms)  # fmt: skip
    engine = Engine(adapter, model, config)
    budgets: list[int] = []
    engine.on_step = lambda timing: budgets.append(timing.prefill_budget) if timing.prefill_budget else None
    run_workload(engine, workload)
    assert budgets, "the target was never consulted"
    if target_ms < 0.01:
        assert set(budgets) == {engine.config.block_size}
    assert engine.step_costs.samples > 0 and min(engine.step_costs.coefficients) >= 0


def run_workload(engine: Engine, workload: list[tuple[Prompt, int, list[int]]]) -> dict[str, Result]:
    """The 16 requests in groups of four a step apart, half the embeddings late; checks every output equals
    `generate` and that everything is given back."""
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
    return results
