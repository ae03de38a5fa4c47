"""Our split path over transformers' DynamicCache, greedy: the reference a Qwen3-VL adapter's pieces must equal."""

from __future__ import annotations

from typing import Any

import torch

from services.models.base import BuiltPrompt, PlacedEmbedding, media_forward_kwargs
from services.models.media_span import span_items


def split_greedy(
    adapter: Any,
    model: Any,
    built: BuiltPrompt,
    rows: list[torch.Tensor],
    max_tokens: int,
    chunk: int,
    levels: bool = True,
) -> list[int]:
    """The prompt in chunks of `chunk` rows, each span's rows taken from its item's embedding (`rows`, one tensor
    per item) at its `item_row`, with the DeepStack keywords of the rows the chunk holds unless not `levels`; then
    one token at a time until an eos or `max_tokens`."""
    from transformers import DynamicCache

    items = span_items(built.spans)
    positions = adapter.prompt_positions(model, built.token_ids, built.spans)
    ids, length = torch.tensor(built.token_ids), len(built.token_ids)
    cache = DynamicCache(config=model.config.get_text_config())
    out: list[int] = []
    with torch.no_grad():
        for start in range(0, length, chunk):
            end = min(length, start + chunk)
            placed = []
            for span, item in zip(built.spans, items, strict=True):
                lo, hi = max(start, span.offset), min(end, span.end)
                if lo < hi:
                    first = span.item_row - span.offset
                    placed.append(PlacedEmbedding(lo - start, rows[item][lo + first : hi + first]))
            embeds = adapter.embed_prompt(model, ids[start:end], placed)
            extra = media_forward_kwargs(adapter, placed, end - start) if levels else {}
            hidden = adapter.forward_hidden(
                model, embeds[None], positions.positions[:, None, start:end], cache=cache, **extra
            )
        while True:
            token = int(adapter.compute_logits(model, hidden[:, -1]).argmax(-1))
            out.append(token)
            if token in adapter.eos_token_ids or len(out) == max_tokens:
                return out
            step = adapter.embed_prompt(model, torch.tensor([token]), [])
            pos = adapter.decode_positions(length + len(out) - 1, 1, positions.rope_delta)
            hidden = adapter.forward_hidden(model, step[None], pos[:, None, :], cache=cache)
