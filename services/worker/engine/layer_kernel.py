"""A decoder layer's RMSNorm (after its residual add) and rotary embedding in C (``layer_kernel.c``), with torch's bits.

transformers' RMSNorm is six to ten torch calls and its rotary five, each paying ~3-5 us of dispatch and a fresh
tensor on a CPU; on a small model's decode step that was ~8 % of the step (256-wide, 8 layers, 16 rows: 17 norms at
~26 us and 8 rotaries at ~24 us on an AVX2 EPYC). `LayerKernel` computes both in one ctypes call each, in the same
order of operations as torch's CPU kernels, including its summation order for the norm's mean (which follows the
vector width of torch's sum kernel: found by computing both widths' sums against torch's at load, since an AVX-512 CPU
runs torch's AVX2 sum, 8 floats wide, not the 16 its capability names). It implements the lean forward's `LayerOps`;
the model runner hands it to `LeanDecoder.probe`, which takes it only where the whole forward is the same bits as
transformers'. Tensors it does not take (another dtype, a layout without a contiguous last dimension) go to torch's
formulas (`TORCH_OPS`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from services.models.lean_decoder import TORCH_OPS
from services.worker.engine.native_library import load_library

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-ffp-contract=off",)
"""Every product and sum rounded on its own, as torch's kernels do: no fused multiply-add."""
DTYPES = (torch.float32, torch.bfloat16)
TORCH_GRAIN = 32768
"""torch sums a row this long or longer on several threads at once, in another order: those stay torch's."""


LANES = (8, 16)
"""The vector widths, in floats, torch's CPU sums may be ordered by (AVX2's and AVX-512's)."""
LANES_PROBE_WIDTH = 1000
"""A row with vectors of either width, a cascade of them and a scalar tail: the width the lane count is found on."""


class LayerKernel:
    """`LayerOps` in C: ``add_rms_norm(norm, hidden, residual)`` and ``rotate(x, cos, sin)``.

    Invariant: each returns what `TORCH_OPS` returns for the same arguments, bit for bit, where torch's sums run in
    ``lanes``-float vectors (a probe decides; tests compare both across widths, row counts and dtypes)."""

    def __init__(self, library: ctypes.CDLL, lanes: int) -> None:
        if lanes not in (8, 16):
            raise ValueError(f"layer kernel: torch's vector width is 8 or 16 floats, not {lanes}")
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        norm = library.epd_add_rms_norm
        norm.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
        norm.restype = ctypes.c_int
        rotary = library.epd_rotary
        rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
        rotary.restype = None
        self._norm, self._rotary, self.lanes = norm, rotary, lanes

    def add_rms_norm(self, norm: Any, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden += residual`` (in place, when given), then ``norm``'s RMSNorm of ``hidden``, a new tensor."""
        weight = norm.weight
        if not (
            hidden.dtype in DTYPES
            and hidden.is_contiguous()
            and hidden.device.type == "cpu"
            and weight.dtype == hidden.dtype
            and weight.is_contiguous()
            and weight.shape == hidden.shape[-1:]
            and hidden.shape[-1] < TORCH_GRAIN
            and (residual is None or (residual.dtype == hidden.dtype and residual.shape == hidden.shape
                                      and residual.is_contiguous()))
        ):  # fmt: skip
            return TORCH_OPS.add_rms_norm(norm, hidden, residual)
        width = hidden.shape[-1]
        out = torch.empty_like(hidden)
        rc = self._norm(
            hidden.data_ptr(), None if residual is None else residual.data_ptr(), hidden.numel() // width, width,
            weight.data_ptr(), norm.variance_epsilon, out.data_ptr(), hidden.dtype == torch.bfloat16, self.lanes,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"layer kernel: no memory for a row of {width} floats")
        return out

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x [1, heads, rows, dim]`` (any strides, the last 1) and ``cos``,
        ``sin [1, 1, rows, dim]``; a new contiguous tensor."""
        dims_ok = x.dim() == 4 and x.shape[0] == 1 and x.shape[-1] % 2 == 0 and cos.shape == sin.shape
        if not (
            dims_ok
            and x.dtype in DTYPES
            and x.device.type == "cpu"
            and cos.dtype == x.dtype == sin.dtype
            and cos.shape == (1, 1, *x.shape[2:])
            and x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and cos.stride(2) == sin.stride(2)
        ):
            return TORCH_OPS.rotate(x, cos, sin)
        _, heads, rows, dim = x.shape
        out = torch.empty(1, heads, rows, dim, dtype=x.dtype)
        self._rotary(
            x.data_ptr(), heads, rows, dim, x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), cos.stride(2),
            out.data_ptr(), x.dtype == torch.bfloat16,
        )  # fmt: skip
        return out

    def matches_torch(self, width: int, dtype: torch.dtype) -> bool:
        """Whether the norm gives `TORCH_OPS`'s bits on 64 random rows of ``width`` (with a residual and without)
        and the rotary on 64-wide heads: the summation order checked on many more rows than a forward's probe."""
        gen = torch.Generator().manual_seed(0)
        norm = _Norm(torch.randn(width, generator=gen).to(dtype))
        scale = torch.logspace(-3, 3, 64).view(1, 64, 1)
        hidden, residual = (scale * torch.randn(2, 64, width, generator=gen)).to(dtype).split(1)
        ours, theirs = hidden.clone(), hidden.clone()
        same = torch.equal(self.add_rms_norm(norm, ours, residual), TORCH_OPS.add_rms_norm(norm, theirs, residual))
        same = same and torch.equal(ours, theirs)
        same = same and torch.equal(self.add_rms_norm(norm, hidden), TORCH_OPS.add_rms_norm(norm, hidden.clone()))
        x, cos, sin = torch.randn(3, 4, 64, 64, generator=gen).to(dtype).split(1)
        cos, sin = cos[:, :1], sin[:, :1]
        return same and torch.equal(self.rotate(x, cos, sin), TORCH_OPS.rotate(x, cos, sin))

    def __repr__(self) -> str:
        return f"C norms and rotary ({self.lanes}-float sums)"


class _Norm:
    """An RMSNorm's two attributes the formulas read."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.variance_epsilon = weight, 1e-6


@functools.cache
def load_layer_kernel() -> LayerKernel | None:
    """The kernel, compiled on first use (cached on disk, native_library.py), summing in the vector width whose order
    gives torch's bits on this CPU; None when it cannot be built or neither width does (torch's formulas then)."""
    library = load_library(SOURCE, FLAGS)
    if library is None:
        return None
    for lanes in LANES:
        kernel = LayerKernel(library, lanes)
        if kernel.matches_torch(LANES_PROBE_WIDTH, torch.float32):
            return kernel
    return None
