"""What `epd profile` measures and how often (`ProfileOptions`, `QUICK`), shared by its two parts."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.capacity import profile as prof

Log = Callable[[str], None]


@dataclass(frozen=True)
class ProfileOptions:
    """Sizes measured and how often. Image sides are widths of 4:3 images (height = 3/4 width); like photos they
    are no multiple of the model's patch, so the processor really resizes them."""

    image_sides: tuple[int, ...] = (250, 500, 750, 1000)
    prefill_tokens: tuple[int, ...] = (64, 256, 1024, 2048, 4096)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_steps: int = 16
    transfer_megabytes: tuple[float, ...] = (0.25, 1.0, 4.0, 16.0)
    repeats: int = 5
    probe_repeats: int = 12
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0
    """torch threads for part 1; 0: what each service of a one-encoder, one-worker `epd up` gets."""
    startup_timeout_s: float = 180.0

    def problems(self) -> list[str]:
        """What keeps these sizes from determining the curves (`profile.py`'s terms); empty when nothing does."""
        needs = [
            ("image sides", len(set(self.image_sides)), len(prof.TOWER_TERMS)),
            ("prefill sizes", len(set(self.prefill_tokens)), len(prof.PREFILL_TERMS)),
            ("decode batches", len(set(self.decode_batches)), 2),
            ("decode contexts", len(set(self.decode_contexts)), 2),
            ("transfer sizes", len(set(self.transfer_megabytes)), len(prof.TRANSPORT_TERMS)),
        ]
        return [f"{have} {name} cannot fit a curve: give at least {need}" for name, have, need in needs if have < need]


QUICK = ProfileOptions(
    image_sides=(160, 320, 480),
    prefill_tokens=(32, 128, 384),
    decode_batches=(1, 4),
    decode_contexts=(64, 256),
    decode_steps=4,
    transfer_megabytes=(0.25, 1.0),
    repeats=1,
    probe_repeats=1,
)
"""A smoke run: the same steps at the smallest sizes."""


def service_threads() -> int:
    """torch threads each service of a one-encoder, one-worker local cluster gets (services/launch/local.py)."""
    return max(1, (os.cpu_count() or 1) // 2)


def torch_dtype(name: str) -> Any:
    from services.capacity.model_sizes import DTYPES

    return DTYPES[name]
