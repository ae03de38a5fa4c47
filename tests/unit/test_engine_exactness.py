"""Exactness: 16 concurrent requests (text only, and one to three images) through the engine give, each, exactly
transformers' greedy `generate` for that request alone; at token budgets 16, 64 and 512 (prefill is chunked in the
first two), with prefix caching on and off (the Triton kernel, slow in its interpreter: budget 64 with caching, 8 of
the 16 requests: `INTERPRETED_REQUESTS`), arrivals and embeddings staggered; and under an inter-token latency target
(prefill chunks sized by measured step costs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from tests.engine_support import (
    BACKENDS,
    INTERPRETED,
    Prompt,
    backend_config,
    interpreted_workload,
    mixed_workload,
    run_workload,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def workload(loaded: tuple[Any, Any], tiny_model_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    return mixed_workload(*loaded, tiny_model_dir)


CASES = [(backend, budget, caching) for backend in BACKENDS for budget in (16, 64, 512) for caching in (True, False)]
CASES += [(backend, 64, True) for backend in INTERPRETED]  # Triton's interpreter: one budget, chunked, cached


@pytest.mark.parametrize(
    ("backend", "budget", "caching"),
    CASES,
    ids=[f"{b}-{budget}-{'cache' if c else 'nocache'}" for b, budget, c in CASES],
)
def test_concurrent_greedy_equals_generate(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]], budget: int, caching: bool, backend: str
) -> None:
    """Every CPU attention path: the compiled kernel (this machine has a C compiler), SDPA, the GPU's varlen call
    with its pure-torch twin, and our Triton kernel (in Triton's interpreter), each of the last two at 16- and
    256-token blocks, the 256 ones through the decode graphs' padded static-buffer path (eagerly: no capture on
    the CPU), the others advancing decode steps of the same sequences in place."""
    adapter, model = loaded
    name, block_size, graphs = {**BACKENDS, **INTERPRETED}[backend]
    config = backend_config(backend, budget, caching)
    engine = Engine(adapter, model, config)
    assert (engine.config.attention_backend, engine.config.block_size) == (name, block_size)
    assert (engine.runner.graphs is not None) == (graphs == "eager")
    results = run_workload(engine, interpreted_workload(workload) if backend in INTERPRETED else workload)
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.steps > 0  # decode-only steps went through the padded graph path
    else:
        assert engine.runner.decodes.advanced > 0  # decode steps of the same sequences were advanced in place
    if caching and block_size == 16:  # 256-token blocks: prefix reuse is tested in test_engine_requests.py
        assert any(r.cached_tokens > 0 for r in results.values())


@pytest.mark.parametrize(
    ("target_ms", "factor"), [(0.001, 0.0), (3.0, 0.0), (0.0, 2.0)], ids=["minimum-chunks", "3ms", "2x-decode-step"]
)
def test_concurrent_greedy_equals_generate_under_an_itl_target(
    loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]], target_ms: float, factor: float
) -> None:
    """With an inter-token latency target the prefill chunks next to decodes are sized by the measured step
    cost (0.001 ms: always the minimum, a block; 3 ms: whatever this machine's steps allow; relative, twice the
    decodes' own predicted step: the same, scaled to the decodes); still exact."""
    adapter, model = loaded
    config = EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=512, max_num_seqs=16, max_model_len=4096,
                          itl_target_ms=target_ms, itl_target_factor=factor)  # fmt: skip
    engine = Engine(adapter, model, config)
    budgets: list[int] = []
    engine.on_step = lambda timing: budgets.append(timing.prefill_budget) if timing.prefill_budget else None
    run_workload(engine, workload)
    assert budgets, "the target was never consulted"
    if 0 < target_ms < 0.01:
        assert set(budgets) == {engine.config.block_size}
    assert engine.step_costs.samples > 0 and min(engine.step_costs.coefficients) >= 0
