"""The engine on the tiny Qwen3-VL: 16 concurrent mixed requests each equal `generate` for that request alone.

Each image's embedding carries its two DeepStack levels (services/models/deepstack.py), which the language model
adds after decoder layers 0 and 1 at the image's rows. Requests are text only or carry one to three images; each
gives exactly transformers' greedy `generate` for it alone, with the cases of tests/unit/test_engine_exactness.py:
token budgets 16, 64 and 512 (at 16 and 64 an image's rows, and so its levels, are split over several steps, next
to other requests' rows), prefix caching on and off, the decode kernel, SDPA and `flash-reference` (16-token blocks,
and 256-token blocks through the decode graphs' padded path), and our Triton kernel in its interpreter at one
budget and block size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models.registry import load_adapter
from services.worker.engine.attention.backend import ATTENTION_NAME
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingOptions
from tests.engine_support import (
    BACKENDS,
    INTERPRETED,
    Prompt,
    Result,
    backend_config,
    drain,
    mixed_workload,
    run_workload,
)


@pytest.fixture(scope="module")
def qwen3_loaded(tiny_qwen3_vl_dir: Path) -> Iterator[tuple[Any, Any]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    adapter = load_adapter(tiny_qwen3_vl_dir)
    yield adapter, adapter.load_model()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workload(qwen3_loaded: tuple[Any, Any], tiny_qwen3_vl_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    adapter, _ = qwen3_loaded
    out = mixed_workload(*qwen3_loaded, tiny_qwen3_vl_dir)
    assert adapter.deepstack_levels == 2
    embeddings = [e for prompt, _, _ in out for e in prompt.embeddings.values()]
    assert embeddings and all(e.shape[1] == 3 * adapter.hidden_size for e in embeddings)  # main + 2 levels
    assert max(m.num_tokens for prompt, _, _ in out for m in prompt.media) > 64  # split at budgets 16 and 64
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_concurrent_greedy_equals_generate(
    qwen3_loaded: tuple[Any, Any],
    workload: list[tuple[Prompt, int, list[int]]],
    budget: int,
    caching: bool,
    backend: str,
) -> None:
    adapter, model = qwen3_loaded
    name, block_size, _ = BACKENDS[backend]
    engine = Engine(adapter, model, backend_config(backend, budget, caching))
    assert (engine.config.attention_backend, engine.config.block_size) == (name, block_size)
    assert model.config.text_config._attn_implementation == ATTENTION_NAME
    results = run_workload(engine, workload)
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.steps > 0  # decode-only steps went through the padded graph path
    if caching and block_size == 16:  # requests 3 and 4 share an image prefix: served from the prefix cache
        assert any(r.cached_tokens > 0 for r in results.values())


def test_concurrent_greedy_equals_generate_with_the_triton_kernel(
    qwen3_loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]]
) -> None:
    """Our Triton kernel in Triton's interpreter (slow: one case, 16-token blocks, budget 64, cached; its 256-token
    graph path is the other families' test: DeepStack rows never reach a decode graph)."""
    adapter, model = qwen3_loaded
    assert "triton16" in INTERPRETED
    engine = Engine(adapter, model, backend_config("triton16", 64, True))
    assert engine.config.attention_backend == "triton"
    run_workload(engine, workload)


def test_an_embedding_without_the_levels_is_refused(
    qwen3_loaded: tuple[Any, Any], workload: list[tuple[Prompt, int, list[int]]]
) -> None:
    """A `[n, hidden]` embedding (a Qwen2-VL-shaped entry of the same hidden size) is never taken for a Qwen3-VL
    item: refused when it arrives, and when a request for it comes after it; the request then runs on the right
    one and still equals `generate`."""
    adapter, model = qwen3_loaded
    prompt, max_tokens, expected = next(w for w in workload if len(w[0].media) == 1)
    ((mm_hash, rows),) = prompt.embeddings.items()
    engine = Engine(adapter, model, backend_config("sdpa", 64, True))
    engine.add_request(prompt.request("r", SamplingOptions(max_tokens=max_tokens)))
    with pytest.raises(ValueError, match=f"rows of {3 * adapter.hidden_size}"):
        engine.provide_embedding(mm_hash, rows[:, : adapter.hidden_size].clone())
    engine.provide_embedding(mm_hash, rows)
    results: dict[str, Result] = {}
    drain(engine, results)
    assert results["r"].tokens == expected
    later = Engine(adapter, model, backend_config("sdpa", 64, True))
    later.embeddings.provide(mm_hash, rows[:, : adapter.hidden_size].clone())  # held before any request needs it
    with pytest.raises(ValueError, match="rows of"):
        later.add_request(prompt.request("s", SamplingOptions(max_tokens=max_tokens)))
