"""The checks a request passes before the engine takes it, and an item's embedding before a request uses it.

Invariant: each check raises ValueError naming the request (or the item) and what is wrong with it, and changes
nothing; the engine runs them on choice 0 (every choice has the same prompt) before it keeps anything.
"""

from __future__ import annotations

from typing import Any

import torch

from services.models.base import placeholder_token_id
from services.models.media_span import MediaSpan
from services.worker.engine.logits_processors import check_token_ids
from services.worker.engine.sequence import Sequence


def check_request(seq: Sequence, adapter: Any, max_model_len: int, vocab_size: int) -> None:
    """A prompt, within the model's length with its new tokens, its media items placed on their own placeholder
    tokens, and sampling's token ids within the vocabulary."""
    if not seq.token_ids:
        raise ValueError(f"request {seq.request_id!r} has no prompt tokens")
    if seq.max_num_tokens > max_model_len:
        raise ValueError(
            f"request {seq.request_id!r}: {seq.num_prompt_tokens} prompt + {seq.sampling.max_tokens} "
            f"new tokens exceed the model's {max_model_len}"
        )
    check_media(seq, adapter)
    check_token_ids(seq.sampling, vocab_size, seq.token_ids[seq.output_start :])


def check_media(seq: Sequence, adapter: Any) -> None:
    """Media items in order, without overlap, inside the request's own prompt, each over its modality's
    placeholder tokens only (a modality the model lacks is refused by `placeholder_token_id`)."""
    end, prompt = 0, seq.num_prompt_tokens - seq.num_generated_before  # media lies in the request's own prompt
    for item in seq.media:
        if item.offset < end or item.num_tokens <= 0 or item.offset + item.num_tokens > prompt:
            raise ValueError(
                f"request {seq.request_id!r}: media item at {item.offset} (+{item.num_tokens}) overlaps, "
                f"is out of order or runs past the prompt"
            )
        end = item.offset + item.num_tokens
        placeholder = placeholder_token_id(adapter, item.modality)
        if any(t != placeholder for t in seq.token_ids[item.offset : end]):
            raise ValueError(f"request {seq.request_id!r}: {item.modality} item at {item.offset} covers other tokens")


def item_rows(media: list[MediaSpan], mm_hash: str) -> int:
    """The embedding rows of item ``mm_hash`` that ``media`` covers (its spans' last ``item_end``); 0 if none."""
    return max((span.item_end for span in media if span.mm_hash == mm_hash), default=0)


def check_rows(mm_hash: str, rows: int, request_id: str, tensor: torch.Tensor, width: int) -> None:
    """An item's embedding must be its ``rows`` at the adapter's `embedding_width` (a tensor of another layout, say
    one without DeepStack levels, is refused here rather than failing a step)."""
    if tensor.dim() != 2 or tuple(tensor.shape) != (rows, width):
        raise ValueError(
            f"embedding {mm_hash[:16]} has shape {tuple(tensor.shape)}, request {request_id!r} "
            f"expects {rows} rows of {width}"
        )
