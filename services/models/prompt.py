"""Family-independent prompt helpers: tokenizing, special-token screening and placeholder expansion.

A family adapter renders its chat template with ONE placeholder token per media item, tokenizes,
then `expand_placeholders` widens each placeholder to the item's token count and records where it
landed. Expanding at the id level equals expanding in text and tokenizing, because placeholders are
added tokens (the tokenizer splits on them before any merge).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.models.base import BuiltPrompt, ChatMessage, ItemTokens, PromptError
from services.models.media_span import MediaSpan


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids by `tokenizer`'s Rust backend: `encode`'s ids without the offsets it also tracks
    (`encode_batch_fast`, ~0.1 ms less for a 256-word prompt, where the router's tokenizing was the largest single
    part of a request's CPU); the transformers wrapper's call adds ~100 us more and the same ids."""
    return tokenizer.backend_tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def check_no_special_text(messages: list[ChatMessage], special_tokens: Iterable[str]) -> None:
    """Raise PromptError when any role or text part contains a special/added token's text.

    The error names the first offending token and the index of the message holding it.
    """
    tokens = sorted({tok for tok in special_tokens if tok}, key=lambda tok: (-len(tok), tok))
    for index, message in enumerate(messages):
        texts = [message.role, *(part.text for part in message.parts if part.kind == "text")]
        for text in texts:
            for token in tokens:
                if token in text:
                    raise PromptError(f"message {index} contains the reserved token {token!r}")


def count_image_parts(messages: list[ChatMessage]) -> int:
    """Number of image parts over the whole conversation."""
    return sum(1 for message in messages for part in message.parts if part.kind == "image")


def expand_placeholders(token_ids: list[int], placeholder_id: int, items: list[ItemTokens]) -> BuiltPrompt:
    """Replace the i-th occurrence of `placeholder_id` with `items[i].num_tokens` copies of it.

    Raises PromptError when the number of placeholders differs from the number of items.
    """
    found = token_ids.count(placeholder_id)  # list.count/index scan in C: a text prompt costs ~1 us, not ~100
    if found != len(items):
        raise PromptError(f"the prompt has {found} image placeholders but {len(items)} items were given")
    at: list[int] = []
    for _ in items:
        at.append(token_ids.index(placeholder_id, at[-1] + 1 if at else 0))
    return _widen(token_ids, at, items)


def media_parts(messages: list[ChatMessage]) -> list[str]:
    """The kinds ("image", "video") of the media parts over the whole conversation, in order."""
    return [part.kind for message in messages for part in message.parts if part.kind != "text"]


def expand_media_placeholders(
    token_ids: list[int], placeholders: dict[str, int], items: list[ItemTokens]
) -> BuiltPrompt:
    """`expand_placeholders` for prompts mixing modalities: the i-th placeholder (of any id in `placeholders`,
    modality -> token id) becomes `items[i].num_tokens` copies of itself, and must be of `items[i].modality`.

    Raises PromptError when the placeholders and the items disagree in number or modality.
    """
    kinds = {token: modality for modality, token in placeholders.items()}
    at = [index for index, token in enumerate(token_ids) if token in kinds]
    if len(at) != len(items):
        raise PromptError(f"the prompt has {len(at)} media placeholders but {len(items)} items were given")
    for index, (position, item) in enumerate(zip(at, items, strict=True)):
        kind = kinds[token_ids[position]]
        if kind != item.modality:
            raise PromptError(f"media item {index} is a {item.modality} but its placeholder is a {kind}'s")
    return _widen(token_ids, at, items)


def _widen(token_ids: list[int], at: list[int], items: list[ItemTokens]) -> BuiltPrompt:
    """The placeholder at `token_ids[at[i]]` (`at` ascending, one per item) as `items[i].num_tokens` copies."""
    out: list[int] = []
    spans: list[MediaSpan] = []
    start = 0
    for position, item in zip(at, items, strict=True):
        out.extend(token_ids[start:position])
        second_per_grid_t = getattr(item, "second_per_grid_t", 0.0)
        spans.append(MediaSpan("", len(out), item.num_tokens, item.grid_thw, item.modality, second_per_grid_t))
        out.extend([token_ids[position]] * item.num_tokens)
        start = position + 1
    out.extend(token_ids[start:])
    media = sum(span.num_tokens for span in spans)
    return BuiltPrompt(token_ids=out, spans=spans, text_tokens=len(out) - media, media_tokens=media)
