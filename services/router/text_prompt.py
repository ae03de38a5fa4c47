"""A raw text prompt (`GenerateRequest.prompt`, the HTTP API's `/v1/completions` and `/tokenize`) as tokens.

Invariant: the text is tokenized as it is, with no chat template: special tokens written in it become
their ids (as vLLM's completions do), except the model's image and video placeholders, which only media
parts may produce (a placeholder without its item would have no embedding), so a prompt holding one is
INVALID_ARGUMENT; an empty prompt (no tokens) too. It costs what a text-only chat request costs: no
media, `projected_tokens = prompt_tokens + n x max_tokens`, checked against the model's context.
"""

from __future__ import annotations

from typing import Any

from services.common.model_info import ModelInfo
from services.models.prompt import encode_ids
from services.router.accounting import Accounted
from services.router.errors import invalid


def placeholder_ids(adapter: Any) -> dict[int, str]:
    """The token ids only media parts may produce, with their text."""
    ids = [adapter.image_token_id, getattr(adapter, "video_token_id", None)]
    return {i: adapter.tokenizer.convert_ids_to_tokens(i) for i in ids if i is not None}


def prompt_token_ids(adapter: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s token ids by the model's tokenizer (its BOS first where it adds one and
    `add_special_tokens`); INVALID_ARGUMENT naming a placeholder token it holds."""
    ids = encode_ids(adapter.tokenizer, text, add_special_tokens)
    placeholders = placeholder_ids(adapter)
    for position, token_id in enumerate(ids):
        if token_id in placeholders:
            raise invalid(
                f"prompt: token {position} is the media placeholder {placeholders[token_id]!r}; "
                "send images and videos as chat content parts"
            )
    return ids


def account_prompt(info: ModelInfo, text: str, max_tokens: int, n: int = 1) -> Accounted:
    """What `text` as a whole prompt costs; INVALID_ARGUMENT when it is empty or cannot fit the context."""
    ids = prompt_token_ids(info.adapter, text)
    if not ids:
        raise invalid("prompt: empty (it has no tokens)")
    total = len(ids) + max_tokens
    if total > info.adapter.max_context:
        raise invalid(
            f"prompt of {len(ids)} tokens plus max_tokens {max_tokens} is {total}, "
            f"longer than the model's context of {info.adapter.max_context} tokens"
        )
    return Accounted(ids, [], [], len(ids), 0, max_tokens, max(n, 1))
