"""A model's linear layers with their weights packed once for the CPU's matrix library, taken only where a probe
finds the packed product bit-identical to ``F.linear``.

``F.linear`` on the CPU hands its weight to oneDNN (bfloat16) or MKL (float32) in the row-major layout a checkpoint
has, and the library reorders it into its blocked layout on every call: a 256 x 512 bfloat16 product of 16 rows
took 41 us on an AMX core, 22 us with the weight packed once, and a float32 one 40 against 26 us with MKL's packed
weight. Decode steps are dozens of such small products, so the weights are packed at start-up, as vLLM's CPU
backend and torch's own compiler (with frozen weights) do. ``pack_linears`` replaces each plain ``nn.Linear`` of a
CPU model in place by a `PackedLinear` when, for its shape and dtype, the packed product equals ``F.linear``'s bits
on every row count of the probe; any other layer (a GPU model, a tensor-parallel layer, a library without the
packed op) is left as it is. A bfloat16 layer keeps only the packed copy (the checkpoint's tensor stays alive only
where it has another owner, a tied embedding); MKL's float32 product also reads the original weight, so a float32
layer holds both (twice its weight bytes: float32 models here are test-sized).

Sibling layers that read the same input (a decoder layer's q, k and v projections; its MLP's gate and up) can be
packed as one product of their weights side by side (``fuse``): a decode step then makes one library call where it
made three, and reads one packed weight. Each part becomes a `PackedSlice` that computes the whole product and keeps
its own columns (what transformers' forward calls); the lean forward calls the fused product once and splits it. A
group is fused only where the probe finds every part's columns equal to that part's ``F.linear`` bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 3, 16, 37, 300)
"""Row counts the probe compares (one decode row, small and odd batches, a prefill chunk)."""

PACK_HINT_ROWS = 16
"""The row count the library packs for (a decode step's; the product takes any count)."""


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in the library's packed layout; the same bits as the ``nn.Linear`` it replaced.

    Invariant: built only by `pack_linears` after its probe passed for this weight's shape and dtype.
    """

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, product: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed  # a plain attribute: state_dict and .to() never see the library's opaque tensor
        self.bias = linear.bias
        self._product = product
        self._original = linear.weight if linear.weight.dtype == torch.float32 else None  # MKL's op reads it too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedSlice(nn.Module):
    """Output columns ``[start, stop)`` of a fused `PackedLinear`: the same bits as the layer it replaced.

    Invariant: built only by `pack_linears` for a group whose fused product passed the probe.
    """

    def __init__(self, fused: PackedLinear, start: int, stop: int) -> None:
        super().__init__()
        self.__dict__["fused"] = fused  # not a child: the group's parts share it, state_dict sees it nowhere
        self.start, self.stop = start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, columns {self.start}..{self.stop} of a fused product"


def _onednn(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


def _mkl(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, layer.packed, layer._original, layer.bias, PACK_HINT_ROWS)


def _pack(weight: torch.Tensor) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
    """The packed weight and the product that takes it; raises where this torch build has no such op."""
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS), _onednn
    if weight.dtype == torch.float32:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_HINT_ROWS), _mkl
    raise TypeError(f"no packed product for {weight.dtype}")


def _same_bits(parts: list[nn.Linear], candidate: PackedLinear) -> bool:
    """True when ``candidate``'s output columns, part by part, are ``F.linear``'s bits of each of ``parts`` (one
    part: the whole output) on random input of every probe row count."""
    generator = torch.Generator().manual_seed(0)
    first = parts[0]
    for rows in PROBE_ROWS:
        x = torch.randn(rows, first.in_features, generator=generator).to(first.weight.dtype)
        got, start = candidate(x), 0
        for part in parts:
            stop = start + part.out_features
            if not torch.equal(F.linear(x, part.weight, part.bias), got[:, start:stop]):
                return False
            start = stop
    return True


FusedGroup = tuple[nn.Module, tuple[str, ...]]
"""A module and the names of its child linear layers to pack as one product, in output-column order."""


def pack_linears(model: nn.Module, groups: list[FusedGroup] | None = None) -> int:
    """Replace every plain ``nn.Linear`` of a CPU ``model`` whose packed product passes the probe; returns how many.

    Each of ``groups`` first becomes one fused product (`fuse`) where it can; its parts then are `PackedSlice` and
    count as replaced. The probe runs once per (in, out, dtype, bias) kind; a kind that fails, or a build without
    the op, keeps ``F.linear`` for every layer of that kind (logged once)."""
    fused_verdicts: dict[tuple, bool] = {}  # per (in, outs, dtype, bias) kind of group, as for single layers
    replaced = sum(len(names) for owner, names in groups or [] if fuse(owner, names, fused_verdicts))
    verdicts: dict[tuple[int, int, torch.dtype, bool], bool] = {}
    with torch.inference_mode():
        for owner in list(model.modules()):
            for name, child in list(owner.named_children()):
                if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                    continue
                kind = (child.in_features, child.out_features, child.weight.dtype, child.bias is not None)
                if verdicts.get(kind) is False:
                    continue
                try:
                    packed = PackedLinear(child, *_pack(child.weight.detach()))
                except (RuntimeError, TypeError, AttributeError) as exc:  # no MKL/oneDNN op in this build
                    log.info("linear layers %s: F.linear (%s)", kind, exc)
                    verdicts[kind] = False
                    continue
                if kind not in verdicts:
                    verdicts[kind] = _same_bits([child], packed)
                    if not verdicts[kind]:
                        log.info("linear layers %s: F.linear (the packed product differs on the probe)", kind)
                        continue
                setattr(owner, name, packed)
                replaced += 1
    log.info("linear layers: %d packed for the CPU's matrix library", replaced)
    return replaced


def fuse(owner: nn.Module, names: tuple[str, ...], verdicts: dict[tuple, bool] | None = None) -> bool:
    """Replace ``owner``'s linear children ``names`` by `PackedSlice` parts of one packed product of their weights
    side by side, when they are plain CPU ``nn.Linear`` layers of one input width and dtype, all with a bias or
    none, and every part's columns pass the probe; False (nothing changed) otherwise. ``verdicts`` keeps the probe's
    answer per kind of group (input width, output widths, dtype, bias), so a model's layers are probed once."""
    parts = [getattr(owner, name, None) for name in names]
    if len(parts) < 2 or any(type(p) is not nn.Linear or p.weight.device.type != "cpu" for p in parts):
        return False
    first = parts[0]
    if any(p.in_features != first.in_features or p.weight.dtype != first.weight.dtype for p in parts):
        return False
    if len({p.bias is None for p in parts}) != 1:
        return False
    verdicts = {} if verdicts is None else verdicts
    kind = (first.in_features, tuple(p.out_features for p in parts), first.weight.dtype, first.bias is not None)
    if verdicts.get(kind) is False:
        return False
    with torch.inference_mode():
        whole = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                          device="meta")  # fmt: skip
        whole.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if first.bias is not None:
            whole.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        try:
            fused = PackedLinear(whole, *_pack(whole.weight))
        except (RuntimeError, TypeError, AttributeError):
            verdicts[kind] = False
            return False
        if kind not in verdicts:
            verdicts[kind] = _same_bits(parts, fused)  # type: ignore[arg-type]
            if not verdicts[kind]:
                log.info("linear layers %s %s: apart (their fused product differs on the probe)", names, kind)
        if not verdicts[kind]:
            return False
    start = 0
    for name, part in zip(names, parts, strict=True):
        setattr(owner, name, PackedSlice(fused, start, start + part.out_features))
        start += part.out_features
    return True
