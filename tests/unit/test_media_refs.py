"""The proto edge of `MediaSpan`: a span survives the wire unchanged, and an unset modality reads as an image."""

from __future__ import annotations

from services.common.media_refs import media_ref, media_span
from services.common.rpc.epd.v1 import common_pb2
from services.models.media_span import MediaSpan


def test_a_span_survives_the_wire() -> None:
    video = MediaSpan("ab" * 32, 7, 24, (2, 4, 12), "video", 0.5)
    ref = common_pb2.MediaRef.FromString(media_ref(video, (0, 3, 6, 9)).SerializeToString())
    assert media_span(ref) == video
    assert list(ref.frame_indices) == [0, 3, 6, 9]
    image = MediaSpan("cd" * 32, 0, 4)
    assert media_span(common_pb2.MediaRef.FromString(media_ref(image).SerializeToString())) == image


def test_an_unset_modality_is_an_image() -> None:
    assert media_span(common_pb2.MediaRef(mm_hash="h", offset=3, num_tokens=2)) == MediaSpan("h", 3, 2)
