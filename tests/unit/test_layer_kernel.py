"""The C RMSNorm and rotary: torch's bits on every width, row count and dtype the lean forward hands them, torch's own
formulas for what they do not take, and a build whose sums run in another order refused by the lean forward's probe
(the engine then keeps torch's formulas)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models.lean_decoder import TORCH_OPS
from services.models.registry import load_adapter
from services.worker.engine import model_runner
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.layer_kernel import LayerKernel, load_layer_kernel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel() -> LayerKernel:
    loaded = load_layer_kernel()
    assert loaded is not None, "the layer kernel did not build (is a C compiler installed?)"
    return loaded


def _norm(width: int, dtype: torch.dtype, gen: torch.Generator) -> Any:
    return types.SimpleNamespace(weight=torch.randn(width, generator=gen).to(dtype), variance_epsilon=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_gives_torchs_bits_with_and_without_the_residual(kernel: LayerKernel, dtype: torch.dtype) -> None:
    """Widths below one vector, with a scalar tail, past torch's first cascade level (8,192 floats: 256 groups of
    four 8-float vectors) and wider; one row to a prefill's many. The residual add is written back, as `add_`."""
    gen = torch.Generator().manual_seed(3)
    for width in (8, 100, 256, 1536, 3584, 8192, 20000):
        for rows in (1, 5, 16, 33):
            norm = _norm(width, dtype, gen)
            hidden = (3 * torch.randn(1, rows, width, generator=gen)).to(dtype)
            residual = torch.randn(1, rows, width, generator=gen).to(dtype)
            ours, theirs = hidden.clone(), hidden.clone()
            expected = TORCH_OPS.add_rms_norm(norm, theirs, residual)
            assert torch.equal(kernel.add_rms_norm(norm, ours, residual), expected), (width, rows)
            assert torch.equal(ours, theirs), "the residual add differs"
            alone = kernel.add_rms_norm(norm, hidden)
            assert torch.equal(alone, TORCH_OPS.add_rms_norm(norm, hidden.clone())), (width, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_gives_torchs_bits_on_the_strided_columns_of_a_fused_product(
    kernel: LayerKernel, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    for heads, rows, dim in ((6, 1, 64), (6, 16, 64), (3, 7, 128), (2, 5, 16)):
        product = torch.randn(1, rows, heads * dim + 32, generator=gen).to(dtype)  # q and k columns, then v's
        x = product[..., : heads * dim].view(1, rows, heads, dim).transpose(1, 2)
        cos = torch.randn(1, rows, dim, generator=gen).to(dtype).unsqueeze(1)
        sin = torch.randn(1, rows, dim, generator=gen).to(dtype).unsqueeze(1)
        ours = kernel.rotate(x, cos, sin)
        assert ours.is_contiguous() and torch.equal(ours, TORCH_OPS.rotate(x, cos, sin)), (heads, rows, dim)


def test_what_it_does_not_take_goes_to_torchs_formulas(kernel: LayerKernel) -> None:
    gen = torch.Generator().manual_seed(5)
    norm = _norm(64, torch.float16, gen)
    half = torch.randn(1, 3, 64, generator=gen).half()
    assert torch.equal(kernel.add_rms_norm(norm, half), TORCH_OPS.add_rms_norm(norm, half.clone()))
    strided = torch.randn(1, 64, 3, generator=gen).transpose(1, 2)  # not contiguous
    norm32 = _norm(64, torch.float32, gen)
    assert torch.equal(kernel.add_rms_norm(norm32, strided), TORCH_OPS.add_rms_norm(norm32, strided))
    x, cos = torch.randn(2, 3, 4, 16, generator=gen), torch.randn(2, 1, 4, 16, generator=gen)  # a batch of two
    assert torch.equal(kernel.rotate(x, cos, cos), TORCH_OPS.rotate(x, cos, cos))


def test_the_engine_takes_it_on_the_cpu(tiny_model_dir: Path) -> None:
    """Every engine test on the CPU (the exactness ones against `generate` among them) then runs it."""
    adapter = load_adapter(tiny_model_dir)
    engine = Engine(adapter, adapter.load_model(), EngineConfig(max_num_seqs=4))
    assert engine.runner.lean is not None and isinstance(engine.runner.lean.ops, LayerKernel)


def test_sums_in_another_order_fail_the_probe(
    kernel: LayerKernel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel told a vector width torch does not use sums the norm's squares in another order: its own check
    and the lean forward's probe find other bits, and the model runner keeps the lean forward with torch's
    formulas."""
    wrong = LayerKernel.__new__(LayerKernel)
    wrong.__dict__.update(kernel.__dict__, lanes=24 - kernel.lanes)  # AVX-512's width where torch runs AVX2's, or back
    gen = torch.Generator().manual_seed(6)
    hidden, norm = torch.randn(1, 16, 1536, generator=gen), _norm(1536, torch.float32, gen)
    assert not torch.equal(wrong.add_rms_norm(norm, hidden), TORCH_OPS.add_rms_norm(norm, hidden))
    assert kernel.matches_torch(64, torch.float32) and not wrong.matches_torch(64, torch.float32)
    monkeypatch.setattr(model_runner, "load_layer_kernel", lambda: wrong)
    adapter = load_adapter(tiny_model_dir)
    engine = Engine(adapter, adapter.load_model(), EngineConfig(max_num_seqs=4))
    assert engine.runner.lean is not None and engine.runner.lean.ops is TORCH_OPS
