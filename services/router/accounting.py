"""What a request costs before any GPU work: its prompt tokens, media tokens and projected total.

`projected_tokens = prompt_tokens + n x max_tokens` (n choices); the router admits against it and
returns it from CountTokens. Token counts come from the model's own resize rule (the adapter), the
same numbers its processor would produce; a video's from its header, through the frames the model's
sampling takes, which travel with the item (`MediaRef.frame_indices`) so the encoder decodes exactly
those.

An item is what the encoder encodes and the cache keeps (`refs`, one per item, with its whole grid); where it
sits in the prompt is one span or, for a family that writes text between parts of an item (Qwen3-VL's
timestamps between a video's frame groups), several (`media_spans`, what the worker and the block hashes use).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from services.common.hashing import mm_hash
from services.common.media_refs import media_ref, media_span
from services.common.model_info import ModelInfo
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.models.base import ImageSizeError, ItemTokens, PromptError, VideoError, VideoTokens
from services.models.media_span import MediaSpan, span_items
from services.router.errors import invalid
from services.router.intake import Intake, MediaItem


@dataclass(frozen=True)
class Accounted:
    token_ids: list[int]
    refs: list[common_pb2.MediaRef]
    item_data: list[bytes]
    text_tokens: int
    image_tokens: int
    max_tokens: int
    n: int = 1
    video_tokens: int = 0
    spans: tuple[MediaSpan, ...] = field(default=())
    """The prompt's media spans (`mm_hash` empty: each takes its item's from `refs`, scoped or not); empty: one
    span per ref, the ref's own."""

    def media_spans(self) -> list[MediaSpan]:
        """Where the items sit in the prompt, with their items' current `mm_hash` (after any tenant scoping)."""
        if not self.spans:
            return [media_span(ref) for ref in self.refs]
        return [
            replace(span, mm_hash=self.refs[item].mm_hash)
            for span, item in zip(self.spans, span_items(list(self.spans)), strict=True)
        ]

    def worker_media(self) -> list[common_pb2.MediaRef]:
        """The worker's media refs: one per span (a video's sampled frames are the encoder's alone)."""
        if not self.spans:
            return list(self.refs)
        return [media_ref(span) for span in self.media_spans()]

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def projected_tokens(self) -> int:
        return self.prompt_tokens + self.n * self.max_tokens

    def token_count(self) -> generation_pb2.TokenCount:
        return generation_pb2.TokenCount(
            prompt_tokens=self.prompt_tokens,
            text_tokens=self.text_tokens,
            image_tokens=self.image_tokens,
            video_tokens=self.video_tokens,
            max_tokens=self.max_tokens,
            projected_tokens=self.projected_tokens,
            tokens_per_item=[ref.num_tokens for ref in self.refs],
        )


def account(info: ModelInfo, intake: Intake, max_tokens: int, n: int = 1) -> Accounted:
    """Build the prompt and its media refs; INVALID_ARGUMENT if it cannot fit the model's context (each of
    the ``n`` choices holds the prompt and its own ``max_tokens``)."""
    adapter = info.adapter
    geometry = [_item_tokens(adapter, item) for item in intake.items]
    try:
        prompt = adapter.build_prompt(intake.messages, geometry)
    except PromptError as exc:
        raise invalid(str(exc)) from exc
    total = len(prompt.token_ids) + max_tokens
    if total > adapter.max_context:
        raise invalid(
            f"prompt of {len(prompt.token_ids)} tokens plus max_tokens {max_tokens} is {total}, "
            f"longer than the model's context of {adapter.max_context} tokens"
        )
    firsts = [span for span in prompt.spans if span.item_row == 0]  # each item's first span
    refs = [
        media_ref(
            replace(
                span,
                mm_hash=mm_hash(info.identity, item.modality, item.data),
                num_tokens=tokens.num_tokens,
                grid_thw=tokens.grid_thw,
            ),
            getattr(tokens, "frame_indices", ()),
        )
        for item, span, tokens in zip(intake.items, firsts, geometry, strict=True)
    ]
    video = sum(ref.num_tokens for ref in refs if ref.modality == "video")
    split = len(prompt.spans) != len(refs)
    return Accounted(
        prompt.token_ids,
        refs,
        [item.data for item in intake.items],
        prompt.text_tokens,
        prompt.media_tokens - video,
        max_tokens,
        max(n, 1),
        video,
        tuple(prompt.spans) if split else (),
    )


def _item_tokens(adapter: Any, item: MediaItem) -> ItemTokens | VideoTokens:
    """The item's tokens by the model's rules; INVALID_ARGUMENT (naming the item) when they refuse it."""
    header = item.header
    try:
        if item.modality == "video":
            return adapter.video_tokens(header.width, header.height, header.frames, header.fps)
        return adapter.image_tokens(header.width, header.height)
    except (ImageSizeError, VideoError) as exc:
        raise invalid(f"{item.modality} {item.index}: {exc}" if item.modality == "video" else str(exc)) from exc
