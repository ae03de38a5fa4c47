"""A stand-in for the matrix library's packed product that computes each part of a fused group on its own.

`models/packed_linear.py` takes a packed or fused product only where the probe finds `F.linear`'s bits; whether
the library's product gives them depends on the machine (its blocking for each width and dtype). Tests that must
exercise the fused path everywhere install `by_parts` as `packed_linear._pack`: each part's columns are
`F.linear` of that part's own weight, so the probe passes by construction and any difference downstream is the
code under test, not the library.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def by_parts(
    groups: list[list[torch.Tensor]],
) -> Callable[[torch.Tensor], tuple[torch.Tensor, Callable[..., torch.Tensor]]]:
    """A `_pack` whose product, for a weight that is one of `groups`' weights side by side (each group a list of
    its parts' weights), is each part's `F.linear` side by side; for any other weight, its own `F.linear`."""

    def parts_of(weight: torch.Tensor) -> list[torch.Tensor]:
        for parts in groups:
            if sum(w.shape[0] for w in parts) == weight.shape[0] and torch.equal(torch.cat(parts), weight):
                return parts
        return [weight]

    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
        # the parts' own tensors, not views of the joined weight: the library's bits can depend on where a weight's
        # rows lie in memory (a safetensors folder's weights start 40 bytes past a 64-byte line; a copy gave other
        # bits at some row counts on an AVX2 host)
        weights = parts_of(weight)
        starts = list(itertools.accumulate([0, *(w.shape[0] for w in weights)]))

        def product(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
            outs = []
            for w, start, stop in zip(weights, starts, starts[1:], strict=False):
                outs.append(F.linear(x, w, None if layer.bias is None else layer.bias[start:stop]))
            return torch.cat(outs, dim=-1)

        return weight, product

    return pack
