"""Which requests the router prepares on its event loop: short text with small images, inline or as data: URLs."""

from __future__ import annotations

import base64

from services.common.rpc.epd.v1 import generation_pb2
from services.router.request_prep import INLINE_IMAGE_BYTES, INLINE_TEXT_CHARS, _is_small


def _request(*parts: generation_pb2.ContentPart) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(messages=[generation_pb2.Message(role="user", content=list(parts))])


def _text(chars: int) -> generation_pb2.ContentPart:
    return generation_pb2.ContentPart(text="x" * chars)


def _image(size: int, as_data_url: bool = False) -> generation_pb2.ContentPart:
    if as_data_url:
        url = "data:image/jpeg;base64," + base64.b64encode(b"\xff" * size).decode()
        return generation_pb2.ContentPart(image=generation_pb2.Media(url=url))
    return generation_pb2.ContentPart(image=generation_pb2.Media(data=b"\xff" * size))


def test_short_text_and_small_images_are_prepared_inline() -> None:
    assert _is_small(_request(_text(INLINE_TEXT_CHARS)))
    assert _is_small(_request(_image(100_000), _text(40)))
    assert _is_small(_request(_image(100_000, as_data_url=True), _text(40)))
    assert _is_small(generation_pb2.GenerateRequest(prompt="x" * 100))


def test_long_text_large_images_video_and_remote_urls_go_to_a_thread() -> None:
    assert not _is_small(_request(_text(INLINE_TEXT_CHARS + 1)))
    assert not _is_small(_request(_image(INLINE_IMAGE_BYTES // 2), _image(INLINE_IMAGE_BYTES // 2 + 1)))
    assert not _is_small(_request(_image(INLINE_IMAGE_BYTES + 4096, as_data_url=True)))
    video = generation_pb2.ContentPart(video=generation_pb2.Media(data=b"\x00" * 100))
    assert not _is_small(_request(video))
    remote = generation_pb2.ContentPart(image=generation_pb2.Media(url="https://example.com/a.png"))
    assert not _is_small(_request(remote))
