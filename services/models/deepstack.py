"""DeepStack embeddings as one tensor per item: the main rows and each level's side by side, and one step's inputs.

Qwen3-VL's tower gives each media item, besides its projected embedding `[n, H]`, one feature map `[n, H]` per
DeepStack level, which the language model adds to its hidden states at the item's positions after decoder layers
0, 1, ... (transformers' `Qwen3VLTextModel._deepstack_process`). Here an item's embedding is one `[n, H x (1 +
levels)]` tensor: row i is the main row of token i, then level 0's row, level 1's, ... So everything that moves or
keeps an item's rows as one tensor (both transports, both cache tiers, the worker's pool, a prefill chunk's slice
of rows) carries every level with no change, and a chunk that splits an item slices all levels alike. The layout
(`LAYOUT` and the level count) is in the adapter's processor settings, so the content hash of an item differs from
any other layout's and no entry of another layout is ever read as this one.
"""

from __future__ import annotations

from typing import Any

import torch

from services.models.base import PlacedEmbedding

LAYOUT = "main+deepstack-columns"
"""The name of this layout in processor settings (it enters `mm_hash`)."""


def join(main: torch.Tensor, levels: list[torch.Tensor]) -> torch.Tensor:
    """`[n, H x (1 + len(levels))]`: `main [n, H]` then each level `[n, H]`, side by side."""
    return torch.cat([main, *levels], dim=1) if levels else main


def main_rows(rows: torch.Tensor, hidden: int) -> torch.Tensor:
    """The main embedding columns of joined rows."""
    return rows[:, :hidden]


def level_rows(rows: torch.Tensor, hidden: int, level: int) -> torch.Tensor:
    """Level `level`'s columns of joined rows."""
    return rows[:, hidden * (level + 1) : hidden * (level + 2)]


def step_inputs(placed: list[PlacedEmbedding], num_tokens: int, hidden: int, levels: int) -> dict[str, Any]:
    """The language model's DeepStack keywords for one flattened step of `num_tokens` rows whose media rows are
    `placed` (joined rows at flat offsets): `visual_pos_masks [1, num_tokens]`, True at exactly the placed rows,
    and `deepstack_visual_embeds`, per level the placed rows' level columns in row order. {} without placed rows
    or levels (the model then adds nothing). Built on the rows' device from host offsets: nothing waits for it."""
    if not placed or levels == 0:
        return {}
    ordered = sorted(placed, key=lambda p: p.offset)
    device = ordered[0].embedding.device
    mask = torch.zeros((1, num_tokens), dtype=torch.bool, device=device)
    for item in ordered:
        mask[0, item.offset : item.offset + item.embedding.shape[0]] = True
    embeds = [torch.cat([level_rows(p.embedding, hidden, k) for p in ordered]) for k in range(levels)]
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": embeds}
