"""The Qwen2-VL / Qwen2.5-VL vision tower over a batch, with every shape-derived input planned on the host.

Left to itself the tower derives, on the device, from ``grid_thw``: cu_seqlens and max_seqlen, the rotary
position ids and (Qwen2.5-VL) the window index, cu_window_seqlens and their max, each with ``.tolist()`` /
``.item()`` host syncs; `get_image_features` adds one more to split the output. `plan_vision` computes
all of them on the host from the items' known grids (transformers' own `vision_utils` functions run on a
CPU grid, so the numbers are the ones the tower would compute), and `run_vision_tower` hands them to the
tower as its precomputed keyword arguments.

`run_vision_tower` is `stage_batch` then `call_tower`. Staging moves inputs with one host-to-device copy for the
pixels (concatenated and cast to the model dtype in one pass into a pinned buffer on CUDA, copied non-blocking)
and one for the plan's integers (one pinned int32 buffer); the call runs the tower once and splits the merged
output by host-known row counts: nothing in either waits for the device. The output stays on the device (views
of one tensor). `time_tower` times calls on inputs staged beforehand (CUDA events on CUDA): the tower's own cost,
without the host-side concatenation and cast of the pixels.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from transformers import vision_utils
except ImportError:  # an older transformers: its tower derives these inputs itself (see `tower_takes_plan`)
    vision_utils = None

WINDOWED_TYPES = ("qwen2_5_vl_vision",)
"""Vision configs whose tower has window-attention layers (window index, cu_window_seqlens)."""


@dataclass(frozen=True)
class VisionPlan:
    """What the tower needs besides pixels, for a batch of items, as host tensors and host ints.

    ``position_ids [P, 2]`` (P patches), ``cu_seqlens [S+1]`` int32 over the S frames; with windows
    ``window_index [P / merge**2]`` and ``cu_window_seqlens`` int32. ``rows`` is each item's output rows.
    """

    grid_thw: torch.Tensor
    rows: list[int]
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    window_index: torch.Tensor | None = None
    cu_window_seqlens: torch.Tensor | None = None
    max_window_seqlen: int | None = None

    @property
    def patches(self) -> int:
        return int(self.position_ids.shape[0])

    def int_tensors(self) -> list[torch.Tensor]:
        """The integer tensors the device needs, in a fixed order (see `tower_kwargs`); ``grid_thw`` last."""
        parts = [self.position_ids, self.cu_seqlens]
        if self.window_index is not None and self.cu_window_seqlens is not None:
            parts += [self.window_index, self.cu_window_seqlens]
        return parts + [self.grid_thw]

    def tower_kwargs(self, device_ints: list[torch.Tensor]) -> dict[str, Any]:
        """The tower's precomputed keyword arguments, given `int_tensors` on the device (same order)."""
        kwargs: dict[str, Any] = {
            "position_ids": device_ints[0].view(-1, 2),
            "cu_seqlens": device_ints[1],
            "max_seqlen": self.max_seqlen,
        }
        if self.window_index is not None:
            kwargs["window_index"] = device_ints[2].long()  # int32 on the wire, long for indexing
            kwargs["cu_window_seqlens"] = device_ints[3]
            kwargs["max_window_seqlen"] = self.max_window_seqlen
        return kwargs


PLANNED_HELPERS = ("get_vision_position_ids", "get_vision_attention_seqlens")
"""The `vision_utils` functions through which a tower's forward takes the planned inputs from its keywords."""


def tower_takes_plan(tower_type: type) -> bool:
    """Whether a tower of ``tower_type`` reads the planned inputs from its keyword arguments: its module derives
    them through `vision_utils` helpers that take ``kwargs`` (transformers 5.24). A tower that derives them itself
    would refuse them as duplicate keywords, so this is checked from the code, before any call: an error raised
    inside the tower (its attention, say) is never mistaken for a refusal."""
    if vision_utils is None:
        return False
    module = sys.modules.get(tower_type.__module__)
    for name in PLANNED_HELPERS:
        helper = getattr(vision_utils, name, None)
        if helper is None or getattr(module, name, None) is not helper:
            return False
        if "kwargs" not in inspect.signature(helper).parameters:
            return False
    return True


def plan_vision(grids: list[tuple[int, int, int]], vision_config: Any) -> VisionPlan:
    """The tower inputs for items with these ``(t, h, w)`` patch grids, computed on the host.

    Raises ValueError for an empty batch or a grid the spatial merge does not divide.
    """
    if not grids:
        raise ValueError("a vision batch needs at least one item")
    merge = int(vision_config.spatial_merge_size)
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)} is not a positive multiple of the spatial merge {merge}")
    grid = torch.tensor(grids, dtype=torch.long)
    cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
    position_ids = vision_utils.get_vision_position_ids(grid, merge)
    window_index = cu_window = max_window = None
    if vision_config.model_type in WINDOWED_TYPES:
        window_index, cu_window = vision_utils.get_vision_window_index(
            grid, merge, int(vision_config.window_size), int(vision_config.patch_size)
        )
        max_window = _max_length(cu_window)
    return VisionPlan(
        grid_thw=grid,
        rows=[t * h * w // (merge * merge) for t, h, w in grids],
        position_ids=position_ids.to(torch.int32),
        cu_seqlens=cu_seqlens.to(torch.int32),
        max_seqlen=_max_length(cu_seqlens),
        window_index=None if window_index is None else window_index.to(torch.int32),
        cu_window_seqlens=None if cu_window is None else cu_window.to(torch.int32),
        max_window_seqlen=max_window,
    )


def _max_length(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def stage(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``parts`` (same trailing shape) concatenated along dim 0 as one ``dtype`` tensor on ``device``.

    One pass on the host (concatenate and cast together), into pinned memory when ``device`` is CUDA, then
    one non-blocking host-to-device copy; on the CPU the concatenation itself.
    """
    rows = sum(int(p.shape[0]) for p in parts)
    pinned = device.type == "cuda"
    host = torch.empty((rows, *parts[0].shape[1:]), dtype=dtype, pin_memory=pinned)
    torch.cat(parts, out=host)
    return host if device.type == "cpu" else host.to(device, non_blocking=pinned)


def stage_ints(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Integer tensors on ``device`` with one copy: flattened into one int32 buffer, staged, viewed back."""
    flat = stage([p.reshape(-1).to(torch.int32) for p in parts], torch.int32, device)
    out, start = [], 0
    for part in parts:
        out.append(flat[start : start + part.numel()].view(part.shape))
        start += part.numel()
    return out


@dataclass(frozen=True)
class StagedBatch:
    """A batch's tower inputs on the tower's device: pixels in its dtype, ``grid_thw``, the plan's keyword
    arguments, and each item's output rows (host integers)."""

    pixels: torch.Tensor
    grid_thw: torch.Tensor
    kwargs: dict[str, Any]
    rows: list[int]


def stage_batch(visual: torch.nn.Module, pixels: list[torch.Tensor], plan: VisionPlan) -> StagedBatch:
    """The items' pixel rows and the plan's integers on the tower's device (one copy each). Raises ValueError when
    pixels and plan disagree."""
    weight = visual.patch_embed.proj.weight
    if sum(int(p.shape[0]) for p in pixels) != plan.patches:
        raise ValueError(f"{sum(int(p.shape[0]) for p in pixels)} pixel rows for {plan.patches} planned patches")
    device_pixels = stage(pixels, weight.dtype, weight.device)
    device_ints = stage_ints(plan.int_tensors(), weight.device)
    # grid_thw rides along on the device: a tower given every derived input never reads it, and one that
    # recomputes something from it must not get host tensors
    return StagedBatch(device_pixels, device_ints[-1].long(), plan.tower_kwargs(device_ints), plan.rows)


def call_tower(visual: torch.nn.Module, staged: StagedBatch) -> list[torch.Tensor]:
    """One tower call on staged inputs; each item's merged embedding ``[rows_i, out_hidden]`` on the tower's device
    (views of one tensor), in order."""
    merged = visual(staged.pixels, grid_thw=staged.grid_thw, **staged.kwargs).pooler_output
    if merged.shape[0] != sum(staged.rows):
        raise RuntimeError(f"vision tower returned {merged.shape[0]} rows, the plan has {sum(staged.rows)}")
    return list(merged.split(staged.rows))


def run_vision_tower(visual: torch.nn.Module, pixels: list[torch.Tensor], plan: VisionPlan) -> list[torch.Tensor]:
    """`call_tower` on `stage_batch`'s inputs: the encoder's path."""
    return call_tower(visual, stage_batch(visual, pixels, plan))


def time_tower(call: Callable[[], object], device: torch.device, calls: int) -> float:
    """Seconds per ``call()`` (a tower call on inputs staged before: nothing host-side is timed), the mean of
    ``calls`` calls: CUDA events around them on CUDA, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls
