"""Placeholder expansion: each image placeholder becomes its item's tokens, in order."""

from __future__ import annotations

import random

import pytest

from services.models.base import ItemTokens, PromptError
from services.models.media_span import MediaSpan
from services.models.prompt import expand_placeholders

PAD = 9


def _item(num_tokens: int) -> ItemTokens:
    return ItemTokens(
        num_tokens=num_tokens, grid_thw=(1, 2, 2 * num_tokens), resized_height=28, resized_width=28 * num_tokens
    )


def _reference(token_ids: list[int], counts: list[int]) -> tuple[list[int], list[MediaSpan]]:
    out: list[int] = []
    spans: list[MediaSpan] = []
    pending = iter(counts)
    for token in token_ids:
        if token == PAD:
            count = next(pending)
            spans.append(MediaSpan("", len(out), count, _item(count).grid_thw))
            out.extend([PAD] * count)
        else:
            out.append(token)
    return out, spans


@pytest.mark.parametrize("seed", range(20))
def test_expansion_matches_a_token_by_token_reference(seed: int) -> None:
    rng = random.Random(seed)
    pads = rng.randrange(0, 4)
    token_ids: list[int] = []
    for segment in range(pads + 1):  # text (maybe empty) around each placeholder, adjacent ones included
        token_ids.extend(rng.randrange(20, 40) for _ in range(rng.randrange(0, 8)))
        if segment < pads:
            token_ids.append(PAD)
    counts = [rng.randrange(1, 6) for _ in range(pads)]
    built = expand_placeholders(token_ids, PAD, [_item(c) for c in counts])
    expected_ids, expected_spans = _reference(token_ids, counts)
    assert built.token_ids == expected_ids
    assert built.spans == expected_spans
    assert (built.text_tokens, built.media_tokens) == (len(token_ids) - len(counts), sum(counts))


def test_placeholder_and_item_counts_must_agree() -> None:
    with pytest.raises(PromptError, match="2 image placeholders but 1 items"):
        expand_placeholders([1, PAD, 2, PAD], PAD, [_item(3)])
    with pytest.raises(PromptError, match="0 image placeholders but 1 items"):
        expand_placeholders([1, 2], PAD, [_item(3)])
