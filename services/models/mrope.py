"""Multimodal rotary positions (M-RoPE) as used by Qwen2-VL and Qwen2.5-VL, computed without a model.

Rule (the one `get_rope_index` implements): text tokens count up by one on all three axes; an item
with merged grid (t, h, w) starting at position p gets t-axis p + time(frame), h-axis p + row, w-axis
p + column, and the next token continues at p + max(h, w). time(frame) is the frame (temporal patch)
index, except for Qwen2.5-VL's videos: (frame x tokens_per_second x second_per_grid_t), computed in
float32 and truncated, as transformers does. A token decoded at index i >= L sits at i + rope_delta on
every axis, where rope_delta = max position + 1 - L.
"""

from __future__ import annotations

import torch

from services.models.base import Positions
from services.models.media_span import MediaSpan


def merged_grid(grid_thw: tuple[int, int, int], merge_size: int) -> tuple[int, int, int]:
    """The grid the language model sees (spatial axes divided by the merge size)."""
    t, h, w = grid_thw
    if t < 1 or h % merge_size or w % merge_size or h < merge_size or w < merge_size:
        raise ValueError(f"grid {grid_thw} is not a positive multiple of merge size {merge_size}")
    return t, h // merge_size, w // merge_size


def item_length(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Number of placeholder tokens an item with this vision grid occupies."""
    t, h, w = merged_grid(grid_thw, merge_size)
    return t * h * w


def mrope_positions(
    length: int, items: list[MediaSpan], merge_size: int, tokens_per_second: float | None = None
) -> Positions:
    """Positions `[3, length]` for a prompt whose media items sit at `items` (sorted, non-overlapping).

    `tokens_per_second` (Qwen2.5-VL's vision config) scales video time by each item's `second_per_grid_t`;
    None leaves every temporal index unscaled (Qwen2-VL). Raises ValueError when an item overlaps the
    previous one or runs past the end of the prompt.
    """
    if length < 1:
        raise ValueError("a prompt needs at least one token")
    chunks: list[torch.Tensor] = []
    cursor = 0
    current = 0
    for index, item in enumerate(items):
        if item.offset < cursor:
            raise ValueError(f"item {index} at offset {item.offset} overlaps the previous item or is out of order")
        t, h, w = merged_grid(item.grid_thw, merge_size)
        end = item.offset + t * h * w
        if end > length:
            raise ValueError(f"item {index} ends at {end}, past the prompt's {length} tokens")
        chunks.append(_text_positions(current, item.offset - cursor))
        current += item.offset - cursor
        scale = None
        if tokens_per_second is not None and item.modality == "video":
            scale = torch.tensor(item.second_per_grid_t, dtype=torch.float32) * tokens_per_second
        chunks.append(_image_positions(current, t, h, w, scale))
        current += max(h, w)
        cursor = end
    chunks.append(_text_positions(current, length - cursor))
    positions = torch.cat(chunks, dim=1)
    rope_delta = int(positions.max().item()) + 1 - length
    return Positions(positions=positions, rope_delta=rope_delta)


def decode_positions(start: int, count: int, rope_delta: int) -> torch.Tensor:
    """Positions `[3, count]` for tokens at indices start .. start + count - 1 after the prompt."""
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be non-negative, got {start} and {count}")
    row = torch.arange(start, start + count, dtype=torch.long) + rope_delta
    return row.unsqueeze(0).expand(3, count).clone()


def _text_positions(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.long).unsqueeze(0).expand(3, count)


def _image_positions(start: int, t: int, h: int, w: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    times = torch.arange(t, dtype=torch.long) if scale is None else (torch.arange(t) * scale).long()
    frames = times.repeat_interleave(h * w)
    rows = torch.arange(h, dtype=torch.long).repeat_interleave(w).repeat(t)
    cols = torch.arange(w, dtype=torch.long).repeat(t * h)
    return torch.stack([frames, rows, cols]) + start
