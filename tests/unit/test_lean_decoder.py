"""The lean language-model forward: taken where its probe matches transformers' forward bit for bit (Qwen2-VL,
Qwen3-VL, Llava), and then the same logits on real engine steps (chunked prefills beside decodes, over paged KV);
refused by its probe where a layer computes anything else or its rotary is handed other positions, which keeps
transformers' forward."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models import packed_linear
from services.models.lean_decoder import LeanDecoder, projection_groups
from services.models.registry import load_adapter
from services.worker.engine.attention.backend import CONTEXT_KWARG, install_paged_attention
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.parts_product import by_parts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(max_num_batched_tokens=24, max_num_seqs=4)
"""A small token budget, so the measured step holds a prefill chunk beside decodes."""


def _fresh(folder: Path) -> tuple[Any, Any]:
    adapter = load_adapter(folder)
    return adapter, adapter.load_model()


def _mixed_step(engine: Engine) -> list[Any]:
    """The chunks of an engine step holding decodes and a prefill chunk (three prompts, four steps in)."""
    prompts = [[5 + i, 9, 14, 3 + i, 22, 8] * (2 + 3 * i) for i in range(3)]
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", ids, [], SamplingOptions(max_tokens=12, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    chunks = engine.runner.last_chunks
    assert any(c.num_tokens == 1 for c in chunks) and any(c.num_tokens > 1 for c in chunks), chunks
    return chunks


def _mixed_step_logits(adapter: Any, model: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One engine step holding decodes and a prefill chunk, rerun with the lean forward and with transformers'."""
    engine = Engine(adapter, model, CONFIG)
    assert engine.runner.lean is not None
    chunks = _mixed_step(engine)
    lean = engine.runner.staged_forward(chunks, engine.embeddings)()
    decoder, engine.runner.lean = engine.runner.lean, None
    reference = engine.runner.staged_forward(chunks, engine.embeddings)()
    engine.runner.lean = decoder
    return lean, reference, engine


def test_qwen2_vl_steps_take_the_lean_forward_and_give_transformers_logits(loaded: tuple[Any, Any]) -> None:
    lean, reference, _ = _mixed_step_logits(*loaded)
    assert torch.equal(lean, reference)


def test_qwen3_vl_steps_take_the_lean_forward_and_give_transformers_logits(tiny_qwen3_vl_dir: Path) -> None:
    """Qwen3-VL's layers norm each head's queries and keys (q_norm, k_norm) and rotate by interleaved M-RoPE."""
    lean, reference, _ = _mixed_step_logits(*_fresh(tiny_qwen3_vl_dir))
    assert torch.equal(lean, reference)


def test_a_layer_computing_something_else_keeps_transformers_forward(tiny_model_dir: Path) -> None:
    """An MLP whose forward is not gate/up/down (here doubled): the lean forward would skip the difference, so
    its probe refuses it, and the engine's steps go through transformers' forward with the change."""
    adapter, model = _fresh(tiny_model_dir)
    mlp = model.get_decoder().layers[1].mlp
    plain = mlp.forward
    mlp.forward = types.MethodType(lambda self, x: 2 * plain(x), mlp)
    engine = Engine(adapter, model, CONFIG)
    assert engine.runner.lean is None
    engine.add_request(EngineRequest("r", [5, 9, 14, 3], [], SamplingOptions(max_tokens=3, ignore_eos=True)))
    while not any(out.finished for out in engine.step()):
        pass


def test_a_sliding_window_layer_is_not_taken(tiny_model_dir: Path) -> None:
    adapter, model = _fresh(tiny_model_dir)
    model.get_decoder().layers[0].self_attn.sliding_window = 8
    runner = Engine(adapter, model, CONFIG).runner
    assert runner.lean is None


def test_llava_steps_take_the_lean_forward_and_give_transformers_logits(tiny_llava_dir: Path) -> None:
    """Llava's Llama takes one row of positions: the adapter's `language_model_positions` gives it to both."""
    lean, reference, _ = _mixed_step_logits(*_fresh(tiny_llava_dir))
    assert torch.equal(lean, reference)


def test_positions_the_rotary_does_not_take_fail_the_probe(tiny_llava_dir: Path) -> None:
    """Handing Llava's Llama the engine's three rows (as a Qwen takes them) instead of the one its forward gets
    changes its rotary: refused."""
    adapter, model = _fresh(tiny_llava_dir)
    runner = Engine(adapter, model, CONFIG).runner

    def reference(embeds: torch.Tensor, positions: torch.Tensor, attention: Any) -> torch.Tensor:
        kwargs = {"attention_mask": {"full_attention": None}, CONTEXT_KWARG: attention}
        return adapter.forward_hidden(model, embeds, positions, **kwargs)

    args = (model.get_decoder(), reference, runner.device, runner.dtype)
    assert LeanDecoder.probe(*args, positions=adapter.language_model_positions) is not None
    assert LeanDecoder.probe(*args, positions=lambda rows: rows) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("product", ["library", "by-parts"])
def test_fused_projections_give_the_untouched_models_logits(
    tiny_model_dir: Path, dtype: str, product: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a layer's q/k/v and gate/up run as one packed product each where the probe finds each part's bits
    (the library's product: host by host; one computed part by part, tests/parts_product.py: always, so the lean
    forward's split and joint rotary are exercised on every host); the engine's step then gives the logits a model
    never packed nor fused computes through transformers' forward on the same KV."""
    config = EngineConfig(max_num_batched_tokens=24, max_num_seqs=4, dtype=dtype)
    adapter = load_adapter(tiny_model_dir)
    model = adapter.load_model("cpu", config.torch_dtype)
    if product == "by-parts":
        groups = [
            [getattr(owner, name).weight.detach() for name in names]
            for owner, names in projection_groups(model.get_decoder())
        ]
        monkeypatch.setattr(packed_linear, "_pack", by_parts(groups))
    engine = Engine(adapter, model, config)
    layers = engine.runner.lean.layers
    fused = [layer.qkv is not None and layer.gate_up is not None for layer in layers]
    assert all(fused) or (product == "library" and not any(fused))  # one verdict per kind of group
    chunks = _mixed_step(engine)
    fused = engine.runner.staged_forward(chunks, engine.embeddings)()
    untouched = adapter.load_model("cpu", config.torch_dtype)
    install_paged_attention(untouched)  # its attention attends over the step's paged KV, as the engine's does
    assert all(type(layer.self_attn.q_proj) is torch.nn.Linear for layer in untouched.get_decoder().layers)
    engine.runner.model, engine.runner.lean = untouched, None
    plain = engine.runner.staged_forward(chunks, engine.embeddings)()
    assert torch.equal(fused, plain)
