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
from services.worker.engine.engine import Engine
from tests.engine_support import BACKENDS, Prompt, backend_config, mixed_workload, run_workload


@pytest.fixture(scope="module")
def llava_loaded(tiny_llava_dir: Path) -> Iterator[tuple[Any, Any]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    adapter = load_adapter(tiny_llava_dir)
    yield adapter, adapter.load_model()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workload(llava_loaded: tuple[Any, Any], tiny_llava_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    out = mixed_workload(*llava_loaded, tiny_llava_dir)
    assert all(m.num_tokens == 576 for prompt, _, _ in out for m in prompt.media)
    assert len({tuple(expected) for _, _, expected in out}) == len(out)  # the model tells every request apart
    return out


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
    name, block_size, _ = BACKENDS[backend]
    config = backend_config(backend, budget, caching)
    engine = Engine(adapter, model, config)
    assert (engine.config.attention_backend, engine.config.block_size) == (name, block_size)
    assert model.config.text_config._attn_implementation == ATTENTION_NAME  # the Llama's layers are paged
    assert model.config.vision_config._attn_implementation != ATTENTION_NAME
    results = run_workload(engine, workload)
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.steps > 0  # decode-only steps went through the padded graph path
    if caching and block_size == 16:  # requests 3 and 4 share an image prefix: served from cache
        assert any(r.cached_tokens >= 576 for r in results.values())
