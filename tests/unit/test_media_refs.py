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


def test_a_frame_groups_row_survives_the_wire_and_names_its_item() -> None:
    """Spans after the first of an item carry their row of its embedding; `span_items` tells the items apart, and
    block hashes key a span's blocks by the item row they start at, so two groups of one video never share a key."""
    from services.common.block_hash import block_extra_keys
    from services.models.media_span import span_items

    image = MediaSpan("im", 2, 4)
    groups = [MediaSpan("vi", 10 + 9 * k, 6, (1, 4, 6), "video", item_row=6 * k) for k in range(3)]
    for span in groups:
        assert media_span(common_pb2.MediaRef.FromString(media_ref(span).SerializeToString())) == span
    assert span_items([image, *groups, MediaSpan("im2", 40, 4)]) == [0, 1, 1, 1, 2]
    assert [k.offset_in_item for k in block_extra_keys(19, 23, groups)] == [6]
    assert [k.offset_in_item for k in block_extra_keys(12, 30, groups)] == [2, 6, 12]
