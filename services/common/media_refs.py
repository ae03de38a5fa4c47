"""The one conversion between the proto's `MediaRef` and `MediaSpan`, at the gRPC edges of router and worker."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.rpc.epd.v1 import common_pb2
from services.models.media_span import MediaSpan


def media_span(ref: common_pb2.MediaRef) -> MediaSpan:
    """The span a ref carries (an unset modality is an image's)."""
    return MediaSpan(
        ref.mm_hash,
        ref.offset,
        ref.num_tokens,
        tuple(ref.grid_thw),
        ref.modality or "image",
        ref.second_per_grid_t,
        ref.item_row,
    )


def media_ref(span: MediaSpan, frame_indices: Sequence[int] = ()) -> common_pb2.MediaRef:
    """The ref of ``span``; ``frame_indices`` are a video's sampled frames, which only the encoder reads."""
    return common_pb2.MediaRef(
        mm_hash=span.mm_hash,
        modality=span.modality,
        offset=span.offset,
        num_tokens=span.num_tokens,
        grid_thw=list(span.grid_thw),
        second_per_grid_t=span.second_per_grid_t,
        frame_indices=list(frame_indices),
        item_row=span.item_row,
    )
