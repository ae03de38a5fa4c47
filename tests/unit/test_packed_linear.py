"""Linear layers with packed weights: taken for float32 (MKL) and bfloat16 (oneDNN) where the packed product is
``F.linear``'s bits at every row count tried, left alone for other dtypes and where the probe finds a difference;
and the C heap told to keep what it frees (a process then stops faulting its freed blocks back in)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.models import packed_linear
from services.models.packed_linear import PackedLinear, PackedSlice, pack_linears
from tests.parts_product import by_parts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(dtype)


def _probe_passes(layer: nn.Linear) -> bool:
    """The library's probe as `pack_linears` runs it: in inference mode, where ``F.linear`` of a bfloat16 layer with
    a bias takes another path than with autograd on (other bits on an AVX512-BF16 EPYC)."""
    with torch.inference_mode():
        try:
            packed = PackedLinear(layer, *packed_linear._pack(layer.weight.detach()))
        except RuntimeError:  # no such product on this host's CPU
            return False
        return packed_linear._same_bits([layer], packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_give_f_linear_bits_at_every_row_count(dtype: torch.dtype) -> None:
    """Each layer is packed exactly where the library has the packed product and the probe finds it gives the
    layer's bits (machine by machine: an AVX2-only host has no oneDNN packed bfloat16 product, and the layers stay
    ``F.linear``), and the model then gives ``F.linear``'s bits at every row count, the probe's and others."""
    model = _model(dtype)
    reference = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model[::2]]
    probe = [_probe_passes(m) for m in model[::2]]
    assert pack_linears(model) == sum(probe)
    assert [isinstance(m, PackedLinear) for m in model[::2]] == probe
    assert dtype != torch.float32 or all(probe)  # MKL's float32 product is F.linear's on every host seen
    assert not any("packed" in key for key in model.state_dict())
    for rows in (1, 2, 7, 16, 64, 129, 1000):
        x = torch.randn(rows, 64).to(dtype)
        want = F.linear(F.silu(F.linear(x, *reference[0])), *reference[1])
        with torch.inference_mode():
            assert torch.equal(model(x), want), rows
            assert torch.equal(model(x.view(1, rows, 64)), want.view(1, rows, 32))  # a batch dimension too


def test_a_dtype_without_a_packed_product_keeps_f_linear() -> None:
    model = _model(torch.float16)
    assert pack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in model[::2])


def test_a_probe_that_finds_other_bits_keeps_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    real = packed_linear._pack

    def off_by_a_bit(weight: torch.Tensor):  # noqa: ANN202
        packed, product = real(weight)
        return packed, lambda x, layer: torch.nextafter(product(x, layer), torch.tensor(float("inf")))

    monkeypatch.setattr(packed_linear, "_pack", off_by_a_bit)
    model = _model(torch.float32)
    assert pack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in model[::2])


def test_the_heap_keeps_freed_blocks_instead_of_faulting_them_back() -> None:
    """Minor page faults of 40 rounds of a step-like pattern (blocks of 1-4 MiB allocated, touched and freed with
    some alive at once), in a fresh interpreter with and without `keep_freed_memory`: glibc's default maps most
    blocks afresh and returns them, ~264k faults here, against ~7k."""
    script = textwrap.dedent(
        """
        import ctypes, resource, sys
        from services.common.heap import keep_freed_memory
        if sys.argv[1] == "keep":
            assert keep_freed_memory()
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(40):
            blocks = []
            for i in range(12):
                size = (1 + i % 4) << 20
                block = libc.malloc(size)
                ctypes.memset(block, 1, size)
                blocks.append(block)
                if i % 3 == 2:
                    libc.free(blocks.pop(0))
            for block in blocks:
                libc.free(block)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    )
    faults = {}
    for mode in ("keep", "default"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
        faults[mode] = int(done.stdout)
    assert faults["keep"] * 5 < faults["default"], faults
    assert faults["keep"] < 40 * 512, faults  # fewer than one fresh MiB a round


class _Attention(nn.Module):
    def __init__(self, bias: bool, v_in: int = 64) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(64, 64, bias=bias), nn.Linear(64, 32, bias=bias)
        self.v_proj = nn.Linear(v_in, 32, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("product", ["library", "by-parts"])
def test_a_fused_group_gives_each_parts_f_linear_bits(
    dtype: torch.dtype, bias: bool, product: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q, k and v as one packed product where the probe passes: each becomes a `PackedSlice` of it with its own
    columns, F.linear's bits of the layer it replaced at every row count tried; the lean forward's product holds
    them side by side. With the library's product the probe decides (it differs on some hosts: the parts stay
    apart, with the same bits); with one computed part by part (tests/parts_product.py) it always passes, so the
    slicing is exercised on every host."""
    torch.manual_seed(1)
    attn = _Attention(bias).to(dtype)
    names = ("q_proj", "k_proj", "v_proj")
    if product == "by-parts":
        monkeypatch.setattr(packed_linear, "_pack", by_parts([[getattr(attn, n).weight.detach() for n in names]]))
    originals = {name: getattr(attn, name) for name in names}
    replaced = pack_linears(attn, [(attn, names)])
    assert replaced == sum(type(getattr(attn, n)) is not nn.Linear for n in names)
    parts = [getattr(attn, name) for name in names]
    fused = all(isinstance(p, PackedSlice) for p in parts)
    assert fused or not any(isinstance(p, PackedSlice) for p in parts)  # the whole group, or none of it
    assert fused or product == "library"
    if fused:
        assert len({id(p.fused) for p in parts}) == 1
        assert [(p.start, p.stop) for p in parts] == [(0, 64), (64, 96), (96, 128)]
        assert not attn.state_dict()  # the fused product is nobody's child: nothing to save or move
    for rows in (1, 2, 7, 16, 64, 129, 1000):
        x = torch.randn(rows, 64).to(dtype)
        with torch.inference_mode():
            whole = parts[0].fused(x) if fused else None
            for name, part in zip(names, parts, strict=True):
                want = F.linear(x, originals[name].weight, originals[name].bias)
                assert torch.equal(part(x), want), (name, rows)
                if whole is not None:
                    assert torch.equal(whole[:, part.start : part.stop], want), (name, rows)


def test_a_group_that_cannot_be_one_product_is_packed_apart() -> None:
    """Parts of different input widths, with and without a bias, or another dtype stay apart (each packed alone
    where it can be)."""
    attn = _Attention(bias=True, v_in=48)
    assert not packed_linear.fuse(attn, ("q_proj", "k_proj", "v_proj"))
    attn = _Attention(bias=True)
    attn.v_proj = nn.Linear(64, 32, bias=False)
    assert pack_linears(attn, [(attn, ("q_proj", "k_proj", "v_proj"))]) == 3
    assert all(isinstance(getattr(attn, n), PackedLinear) for n in ("q_proj", "k_proj", "v_proj"))
    half = _Attention(bias=False).to(torch.float16)
    assert not packed_linear.fuse(half, ("q_proj", "k_proj", "v_proj"))
    assert type(half.q_proj) is nn.Linear


def test_a_fused_product_that_finds_other_bits_keeps_the_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    real = packed_linear._pack

    def off_by_a_bit_when_fused(weight: torch.Tensor):  # noqa: ANN202
        packed, product = real(weight)
        if weight.shape[0] != 128:  # the fused q/k/v product only
            return packed, product
        return packed, lambda x, layer: torch.nextafter(product(x, layer), torch.tensor(float("inf")))

    monkeypatch.setattr(packed_linear, "_pack", off_by_a_bit_when_fused)
    attn = _Attention(bias=True)
    assert pack_linears(attn, [(attn, ("q_proj", "k_proj", "v_proj"))]) == 3
    assert all(isinstance(getattr(attn, n), PackedLinear) for n in ("q_proj", "k_proj", "v_proj"))


def test_each_kind_of_group_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's layers of one shape share the probe's verdict (a 32-layer model is not probed 32 times)."""
    calls = []
    real = packed_linear._same_bits

    def counted(parts, candidate):  # noqa: ANN001, ANN202
        calls.append(len(parts))
        return real(parts, candidate)

    monkeypatch.setattr(packed_linear, "_same_bits", counted)
    layers = nn.ModuleList(_Attention(bias=True) for _ in range(4))
    groups = [(attn, ("q_proj", "k_proj", "v_proj")) for attn in layers]
    assert pack_linears(layers, groups) == 12
    assert calls == [3]
    assert all(isinstance(attn.v_proj, PackedSlice) for attn in layers)
