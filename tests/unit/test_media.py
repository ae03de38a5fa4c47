"""Router-side media checks: header probing, limits, refusals and data: URLs."""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import pybase64
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from services.common.image_bytes import gif_frame_count, sniff_format, webp_size
from services.common.media import (
    SUPPORTED_FORMATS,
    ImageHeader,
    MediaError,
    MediaLimits,
    MediaReason,
    decode_data_url,
    probe_image,
)
from tests import media_factory as mf

LIMITS = MediaLimits()
ALL_FORMATS = MediaLimits(allowed_formats=SUPPORTED_FORMATS)
REPO = Path(__file__).resolve().parents[2]


def refused(data: bytes, limits: MediaLimits = LIMITS, **kw: object) -> MediaError:
    with pytest.raises(MediaError) as info:
        probe_image(data, limits, **kw)  # type: ignore[arg-type]
    return info.value


# --- headers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (mf.png(20, 10), ImageHeader("PNG", 20, 10, 1, 1)),
        (mf.png(20, 10, "RGBA"), ImageHeader("PNG", 20, 10, 1, 1)),
        (mf.png(20, 10, "I;16"), ImageHeader("PNG", 20, 10, 1, 1)),
        (mf.jpeg(30, 20), ImageHeader("JPEG", 30, 20, 1, 1)),
        (mf.jpeg(30, 20, cmyk=True), ImageHeader("JPEG", 30, 20, 1, 1)),
        (mf.webp(20, 10), ImageHeader("WEBP", 20, 10, 1, 1)),
        (mf.webp(20, 10, lossless=True, alpha=True, frames=3), ImageHeader("WEBP", 20, 10, 3, 1)),
        (mf.gif(9, 7), ImageHeader("GIF", 9, 7, 1, 1)),
        (mf.gif_frames(7, 9, 7), ImageHeader("GIF", 9, 7, 7, 1)),
        (mf.apng(4), ImageHeader("PNG", 8, 8, 4, 1)),
        (mf.bmp(3, 4), ImageHeader("BMP", 3, 4, 1, 1)),
    ],
)
def test_probe_reads_format_size_and_frames(data: bytes, expected: ImageHeader) -> None:
    assert probe_image(data, LIMITS) == expected


@pytest.mark.parametrize("orientation", range(1, 9))
def test_size_is_after_exif_orientation_and_matches_exif_transpose(orientation: int) -> None:
    data = mf.jpeg(30, 20, exif_orientation=orientation)
    header = probe_image(data, LIMITS)
    assert header.orientation == orientation
    assert (header.width, header.height) == ((20, 30) if orientation >= 5 else (30, 20))
    assert header.stored_size == (30, 20)
    assert (header.width, header.height) == ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size


@pytest.mark.parametrize(
    "data",
    [
        mf.png(30, 20, exif_orientation=6),
        mf.png(30, 20, exif_orientation=6, exif_after_idat=True),  # PIL needs a decode to see it
        mf.webp(30, 20, exif_orientation=6),
    ],
)
def test_orientation_from_png_and_webp_exif(data: bytes) -> None:
    header = probe_image(data, LIMITS)
    assert (header.width, header.height, header.orientation) == (20, 30, 6)


def test_invalid_orientation_counts_as_upright() -> None:
    assert probe_image(mf.jpeg(30, 20, exif_orientation=9), LIMITS).orientation == 1


def test_tiff_is_supported_but_off_by_default() -> None:
    data = mf.tiff(5, 6, pages=3)
    assert refused(data).reason is MediaReason.FORMAT
    assert str(refused(data)) == "unsupported format 'TIFF'"
    assert probe_image(data, ALL_FORMATS) == ImageHeader("TIFF", 5, 6, 3, 1)


# --- refusals ------------------------------------------------------------------------------------


def test_empty_data() -> None:
    err = refused(b"")
    assert (err.reason, str(err)) == (MediaReason.EMPTY, "empty data")


def test_unsupported_format_is_named() -> None:
    err = refused(mf.ico())
    assert (err.reason, str(err)) == (MediaReason.FORMAT, "unsupported format 'ICO'")


def test_unrecognised_bytes() -> None:
    err = refused(b"hello, this is not an image at all")
    assert (err.reason, str(err)) == (MediaReason.FORMAT, "unrecognised image format")


@pytest.mark.parametrize("data", [mf.png(64, 64), mf.jpeg(64, 64), mf.gif(64, 64), mf.webp(64, 64), mf.bmp(8, 8)])
def test_header_cut_short_is_corrupt_with_the_item_index(data: bytes) -> None:
    err = refused(mf.truncated(data, 20), index=2)
    assert err.reason is MediaReason.CORRUPT
    assert str(err) == "image 2: truncated or corrupt data"
    assert (err.index, err.detail) == (2, "truncated or corrupt data")


def test_pixel_limit_is_inclusive() -> None:
    limits = MediaLimits(max_pixels=200)
    assert probe_image(mf.png_declaring(20, 10), limits).width == 20
    err = refused(mf.png_declaring(21, 10), limits)
    assert (err.reason, str(err)) == (MediaReason.PIXELS, "image is 21x10 = 210 pixels, above the 200 limit")


def test_pixel_message_shows_exact_counts_when_rounding_hides_the_excess() -> None:
    err = refused(mf.png_declaring(7071, 7072))
    assert str(err) == "image is 7071x7072 = 50006112 pixels, above the 50000000 limit"


def test_frame_limit_is_inclusive() -> None:
    limits = MediaLimits(max_frames=5)
    assert probe_image(mf.gif_frames(5), limits).frames == 5
    for data in (mf.gif_frames(6), mf.apng(6), mf.webp(8, 8, frames=6)):
        err = refused(data, limits)
        assert (err.reason, str(err)) == (MediaReason.FRAMES, "animated image with more than 5 frames")
    err = refused(mf.tiff(4, 4, pages=6), MediaLimits(max_frames=5, allowed_formats=SUPPORTED_FORMATS))
    assert err.reason is MediaReason.FRAMES


def test_our_limit_decides_not_pils_global_bomb_check() -> None:
    big = MediaLimits(max_pixels=400_000_000)  # above PIL's 179M decompression-bomb error
    before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning either
        assert probe_image(mf.png_declaring(15000, 15000), big).width == 15000
    assert before == Image.MAX_IMAGE_PIXELS
    # libwebp's canvas guard is the one PIL check we cannot bypass; it still surfaces as ours.
    assert refused(mf.webp_declaring(16000, 12000), big).reason is MediaReason.PIXELS


# --- bombs: refused from the header, fast, without pixel memory ----------------------------------


def _gif_declaring(w: int, h: int) -> bytes:
    data = bytearray(mf.gif(8, 8))
    data[6:10] = struct.pack("<HH", w, h)
    return bytes(data)


BOMBS = {
    "png 50000x50000": (mf.png_declaring(50_000, 50_000), MediaReason.PIXELS),
    "gif 65535x65535": (_gif_declaring(65_535, 65_535), MediaReason.PIXELS),
    "webp 16384x16384": (mf.webp_declaring(16_384, 16_384), MediaReason.PIXELS),
    "gif 5000 frames": (mf.gif_frames(5_000), MediaReason.FRAMES),
}


@pytest.mark.parametrize("name", BOMBS)
def test_bombs_refused_from_header_without_decoding_and_small(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data, reason = BOMBS[name]
    loads = mf.record_pixel_decodes(monkeypatch)
    tracemalloc.start()
    err = refused(data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert err.reason is reason
    assert loads == [], f"{name}: pixel data decoded before the refusal"
    assert peak < 4 * 1024 * 1024, f"{name}: {peak} bytes traced"
    Image.open(io.BytesIO(mf.png(2, 2))).load()
    assert loads == ["PNG"]  # the recording sees a decode when there is one


def test_png_bomb_message() -> None:
    assert str(refused(BOMBS["png 50000x50000"][0])) == "image is 50000x50000 = 2.5e9 pixels, above the 5e7 limit"


def test_bombs_allocate_no_pixel_memory_in_c() -> None:
    """tracemalloc misses PIL's C allocations; a fresh process's peak RSS does not."""
    script = """
import json, resource, struct, sys
from services.common.media import MediaError, MediaLimits, probe_image
from tests import media_factory as mf
data = [mf.png_declaring(50000, 50000), mf.webp_declaring(16384, 16384), mf.gif_frames(5000)]
gif = bytearray(mf.gif(8, 8)); gif[6:10] = struct.pack("<HH", 65535, 65535); data.append(bytes(gif))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
reasons = []
for d in data:
    try:
        probe_image(d, MediaLimits())
    except MediaError as e:
        reasons.append(str(e.reason))
print(json.dumps({"kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "reasons": reasons}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["reasons"] == ["pixels", "pixels", "frames", "pixels"]
    assert result["kib"] < 20 * 1024, result


def test_gif_frame_count_stops_early_and_matches_pil() -> None:
    data = mf.gif_frames(5_000)
    assert gif_frame_count(data, 11) == 11
    assert gif_frame_count(data, 10**6) == 5_000
    frames = [mf.image(6, 5, seed=i).quantize(colors=8) for i in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=30)
    assert gif_frame_count(buf.getvalue(), 100) == Image.open(buf).n_frames == 4


def test_byte_readers_never_raise_on_short_input() -> None:
    for n in range(0, 40):
        junk = b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\x00" * n
        assert webp_size(junk[:n]) is None or n >= 30
        assert gif_frame_count(b"GIF89a"[:n], 5) == 1
        sniff_format(junk[:n])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from([mf.png(12, 9, "P"), mf.jpeg(12, 9, exif_orientation=6), mf.gif_frames(3), mf.webp(12, 9)]),
    cut=st.floats(0.0, 1.0),
    flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 255)), max_size=4),
)
def test_mangled_headers_only_ever_raise_media_error(base: bytes, cut: float, flips: list) -> None:
    data = bytearray(base[: max(1, int(len(base) * cut))])
    for where, value in flips:
        data[min(len(data) - 1, int(len(data) * where))] = value
    try:
        header = probe_image(bytes(data), ALL_FORMATS)
    except MediaError as err:
        assert err.reason in set(MediaReason)
    else:
        assert header.width >= 1 and header.height >= 1 and header.frames >= 1


# --- limits and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"max_pixels": 0}, {"max_frames": -1}, {"allowed_formats": frozenset({"ICO"})}, {"allowed_formats": frozenset()}],
)
def test_limits_are_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        MediaLimits(**kwargs)


def test_limits_normalise_format_case() -> None:
    limits = MediaLimits(allowed_formats=frozenset({"png", "Jpeg"}))
    assert limits.allowed_formats == frozenset({"PNG", "JPEG"})
    assert str(refused(mf.gif(4, 4), limits)) == "unsupported format 'GIF'"


def test_media_error_pickles_and_relabels() -> None:
    err = MediaError("truncated or corrupt data", MediaReason.CORRUPT, index=3)
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), str(copy), copy.reason, copy.index) == (MediaError, str(err), err.reason, 3)
    assert isinstance(copy, ValueError)
    assert str(MediaError("empty data", MediaReason.EMPTY).with_index(0)) == "image 0: empty data"


# --- data: URLs ----------------------------------------------------------------------------------


def _url(payload: bytes, header: str = "data:image/png;base64") -> str:
    return f"{header},{base64.b64encode(payload).decode()}"


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_data_url_round_trip(payload: bytes) -> None:
    assert decode_data_url(_url(payload), max_bytes=300) == payload


def test_data_url_accepts_whitespace_case_and_parameters() -> None:
    png = mf.png(4, 4)
    text = base64.b64encode(png).decode()
    wrapped = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))
    assert decode_data_url(f"DATA:image/png;name=a.png;BASE64,{wrapped}", 10_000) == png


@pytest.mark.parametrize(
    ("url", "reason", "message"),
    [
        ("https://example.com/a.png", MediaReason.ENCODING, "not a data: URL"),
        ("data:image/png,%89PNG", MediaReason.ENCODING, "not base64-encoded"),
        ("data:image/png;base64,", MediaReason.EMPTY, "empty data"),
        ("data:image/png;base64,QUJD=", MediaReason.ENCODING, "bad base64 padding"),
        ("data:image/png;base64,QUJ", MediaReason.ENCODING, "bad base64 padding"),
        ("data:image/png;base64,QU*D", MediaReason.ENCODING, "not valid base64"),
        ("data:image/png;base64,QU-_", MediaReason.ENCODING, "not valid base64"),
        ("data:image/png;base64,QQ==QUJD", MediaReason.ENCODING, "not valid base64"),
    ],
)
def test_data_url_refusals(url: str, reason: MediaReason, message: str) -> None:
    with pytest.raises(MediaError) as info:
        decode_data_url(url, max_bytes=1000)
    assert info.value.reason is reason
    assert message in str(info.value)


def test_data_url_size_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    real_b64decode = pybase64.b64decode

    def recording_b64decode(payload: str, validate: bool = False) -> bytes:
        decoded.append(len(payload))
        return real_b64decode(payload, validate=validate)

    monkeypatch.setattr(pybase64, "b64decode", recording_b64decode)
    url = _url(b"\x00" * 1001)
    with pytest.raises(MediaError) as info:
        decode_data_url(url, max_bytes=1000)
    assert (info.value.reason, str(info.value)) == (
        MediaReason.BYTES,
        "data: URL holds 1001 bytes, above the 1000-byte limit",
    )
    assert decode_data_url(_url(b"\x00" * 1000), max_bytes=1000) == b"\x00" * 1000
    assert decoded == [len(base64.b64encode(b"\x00" * 1000))]  # only the one within the limit was decoded
    huge = "data:image/png;base64," + "A" * 40_000_000  # 30 MB if decoded
    with pytest.raises(MediaError, match="30000000 bytes"):
        decode_data_url(huge, max_bytes=20 * 1024 * 1024)
    assert len(decoded) == 1  # sized from the text's length: never decoded


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 90), st.sampled_from(["", "=", "==", "!", "-", "_", "=A", "é"]))
def test_data_url_decoding_accepts_and_refuses_what_the_standard_library_does(raw: bytes, at: int, insert: str) -> None:
    """The SIMD decoder (pybase64) agrees with `base64.b64decode(validate=True)` on valid and corrupted payloads
    (whitespace, which the data: URL reader drops first, is tested above)."""
    payload = base64.b64encode(raw).decode()
    payload = payload[:at] + insert + payload[at:]
    try:
        expected: bytes | None = base64.b64decode(payload, validate=True) if len(payload) % 4 == 0 and payload else None
    except ValueError:
        expected = None
    try:
        got: bytes | None = decode_data_url("data:image/png;base64," + payload, max_bytes=1 << 20)
    except MediaError:
        got = None
    assert got == expected
