"""Deterministic test images, built in memory as encoded bytes.

Every builder returns the bytes of a complete file (unless its name says otherwise) whose pixels
come from a seeded generator, so the same call always yields the same bytes. Hand-built files
(`png_declaring`, `gif_frames`, `webp_declaring`) exist because PIL refuses to write what they
describe: a header claiming billions of pixels, or thousands of frames in a few kilobytes.
"""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction
from typing import Any

import numpy as np
from PIL import Image


def pattern(w: int, h: int, channels: int = 3, *, seed: int = 0) -> np.ndarray:
    """A smooth gradient plus light seeded noise, uint8, shape (h, w, channels)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([(xx * 255 / max(w - 1, 1) + 40 * c) % 256 for c in range(channels)], axis=-1)
    base += (yy * 128 / max(h - 1, 1))[..., None]
    noise = rng.integers(-12, 13, size=(h, w, channels))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def _encode(img: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def _exif(orientation: int | None) -> Image.Exif | None:
    if orientation is None:
        return None
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def image(w: int, h: int, mode: str = "RGB", *, seed: int = 0) -> Image.Image:
    """An in-memory image of `mode` (RGB, RGBA, LA, L, 1, P, I;16, CMYK) with seeded content."""
    if mode == "I;16":
        ramp = pattern(w, h, 1, seed=seed)[..., 0].astype(np.uint16) * 257
        return Image.fromarray(ramp)  # uint16 array gives mode I;16
    if mode in ("RGBA", "LA"):
        rgba = pattern(w, h, 4, seed=seed)
        rgba[: h // 2, :, 3] = 0  # top half fully transparent
        rgba[h // 2 :, : w // 2, 3] = 128  # bottom-left quarter half transparent
        rgba[h // 2 :, w // 2 :, 3] = 255  # bottom-right quarter opaque
        return Image.fromarray(rgba, "RGBA").convert(mode)
    rgb = Image.fromarray(pattern(w, h, 3, seed=seed), "RGB")
    if mode == "P":
        pal = rgb.quantize(colors=16)
        pal.info["transparency"] = 0  # palette entry 0 is transparent
        return pal
    return rgb if mode == "RGB" else rgb.convert(mode)


def png(
    w: int,
    h: int,
    mode: str = "RGB",
    *,
    seed: int = 0,
    exif_orientation: int | None = None,
    exif_after_idat: bool = False,
) -> bytes:
    """A PNG of `mode`; `exif_after_idat` moves the eXIf chunk behind the pixel data."""
    img = image(w, h, mode, seed=seed)
    params: dict[str, object] = {}
    if mode == "P":
        params["transparency"] = 0
    exif = _exif(exif_orientation)
    if exif is not None and not exif_after_idat:
        params["exif"] = exif
    data = _encode(img, "PNG", **params)
    if exif is not None and exif_after_idat:
        iend = data.rindex(b"IEND") - 4
        data = data[:iend] + _png_chunk(b"eXIf", exif.tobytes()) + data[iend:]
    return data


def jpeg(
    w: int,
    h: int,
    *,
    gray: bool = False,
    exif_orientation: int | None = None,
    cmyk: bool = False,
    quality: int = 90,
    seed: int = 0,
) -> bytes:
    """A baseline JPEG (RGB, grayscale or CMYK), optionally carrying an EXIF orientation."""
    mode = "L" if gray else "CMYK" if cmyk else "RGB"
    img = image(w, h, mode, seed=seed)
    exif = _exif(exif_orientation)
    params: dict[str, object] = {"quality": quality}
    if exif is not None:
        params["exif"] = exif
    return _encode(img, "JPEG", **params)


def webp(
    w: int,
    h: int,
    *,
    lossless: bool = False,
    alpha: bool = False,
    frames: int = 1,
    exif_orientation: int | None = None,
    seed: int = 0,
) -> bytes:
    """A WebP (lossy or lossless, optionally with alpha, optionally animated)."""
    mode = "RGBA" if alpha else "RGB"
    imgs = [image(w, h, mode, seed=seed + i) for i in range(frames)]
    params: dict[str, object] = {"lossless": lossless, "quality": 90}
    exif = _exif(exif_orientation)
    if exif is not None:
        params["exif"] = exif
    if frames > 1:
        params.update(save_all=True, append_images=imgs[1:], duration=40)
    return _encode(imgs[0], "WEBP", **params)


def apng(n: int, w: int = 8, h: int = 8) -> bytes:
    """An animated PNG with `n` distinct frames."""
    imgs = [image(w, h, seed=i) for i in range(n)]
    return _encode(imgs[0], "PNG", save_all=True, append_images=imgs[1:], duration=40)


def bmp(w: int, h: int, *, seed: int = 0) -> bytes:
    """An uncompressed 24-bit BMP."""
    return _encode(image(w, h, seed=seed), "BMP")


def tiff(w: int, h: int, *, pages: int = 1, seed: int = 0) -> bytes:
    """A TIFF, multi-page when `pages` > 1."""
    imgs = [image(w, h, seed=seed + i) for i in range(pages)]
    return _encode(imgs[0], "TIFF", save_all=True, append_images=imgs[1:])


def ico(size: int = 16) -> bytes:
    """A Windows icon: a real image format that is never on the allowlist."""
    return _encode(image(size, size), "ICO", sizes=[(size, size)])


def gif(w: int, h: int, *, seed: int = 0) -> bytes:
    """A single-frame palette GIF."""
    return _encode(image(w, h, seed=seed).quantize(colors=64), "GIF")


def gif_frames(n: int, w: int = 8, h: int = 8) -> bytes:
    """An animated GIF with `n` frames, built by repeating one encoded frame `n` times.

    PIL would merge identical frames when writing, so the frame block (optional extensions,
    image descriptor and LZW data) is cut from a one-frame GIF and repeated by hand; a few kB per
    thousand frames at the default size.
    """
    one = gif(w, h)
    flags = one[10]
    start = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    frame = one[start:-1]  # everything between the global palette and the trailer
    loop = b"!\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    return one[:start] + loop + frame * n + b";"


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def png_declaring(w: int, h: int) -> bytes:
    """A well-formed PNG header declaring `w` x `h` RGB pixels, with a few bytes of real data.

    The IHDR and every other chunk carry correct CRCs, so only the size is a lie; decoding it would
    need w*h*3 bytes, which is what a decompression bomb counts on.
    """
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def webp_declaring(w: int, h: int) -> bytes:
    """A WebP whose extended (VP8X) header declares a `w` x `h` canvas (each at most 16384)."""
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00"
    vp8x += (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    body = b"WEBP" + vp8x + b"VP8L" + struct.pack("<I", 6) + b"\x2f" + b"\x00" * 5
    return b"RIFF" + struct.pack("<I", len(body)) + body


def truncated(data: bytes, keep: int | float = 0.5) -> bytes:
    """The first `keep` bytes of `data` (an int), or that fraction of it (a float)."""
    n = keep if isinstance(keep, int) else int(len(data) * keep)
    if not 0 <= n < len(data):
        raise ValueError(f"keep={keep} does not cut a {len(data)}-byte file")
    return data[:n]


_VIDEO_CODECS = {"mp4": "h264", "webm": "libvpx-vp9", "mkv": "libvpx"}


def video_frames(w: int, h: int, count: int, *, seed: int = 0) -> np.ndarray:
    """`count` RGB frames (count, h, w, 3) uint8: the `pattern` gradient drifting sideways, each frame's noise
    seeded apart, so frames differ visibly and a wrongly sampled frame changes what a model sees."""
    base = pattern(w + count, h, 3, seed=seed)
    return np.stack([np.roll(base, -i, axis=1)[:, :w] for i in range(count)])


def video(
    w: int,
    h: int,
    *,
    seconds: float = 2.0,
    fps: int | Fraction = 15,
    container: str = "mp4",
    codec: str | None = None,
    seed: int = 0,
) -> bytes:
    """A video of `round(seconds * fps)` `video_frames`, encoded in memory with PyAV.

    `container` "mp4" (H.264; 4:4:4 chroma for odd sizes, which 4:2:0 cannot hold) or "webm" (VP9; "mkv" is
    Matroska with VP8); `codec` overrides (e.g. "mpeg4"); `fps` may be a Fraction (30000/1001). The frames
    are reproducible, the encoded bytes not always (libx264 and libvpx may differ run to run).
    """
    import av

    codec = codec or _VIDEO_CODECS[container]
    count = round(seconds * fps)
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska" if container == "mkv" else container) as out:
        stream = out.add_stream(codec, rate=fps, options={"threads": "1"} if codec in ("h264", "libx264") else {})
        stream.width, stream.height = w, h
        odd = w % 2 or h % 2
        stream.pix_fmt = "yuv444p" if odd and codec in ("h264", "libx264") else "yuv420p"
        for frame in video_frames(w, h, count, seed=seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def audio_only(seconds: float = 1.0, container: str = "mp4") -> bytes:
    """A container holding one AAC (mp4) or Opus (webm) audio stream and no video."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("aac" if container == "mp4" else "libopus", rate=48000)
        samples = int(seconds * 48000)
        tone = (np.sin(np.arange(samples) * 0.05) * 0.2).astype(np.float32)[None, :]
        for start in range(0, samples, 960):
            frame = av.AudioFrame.from_ndarray(tone[:, start : start + 960], format="fltp", layout="mono")
            frame.sample_rate = 48000
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _mp4_box(data: bytes | bytearray, path: list[bytes], start: int = 0, end: int | None = None) -> int:
    """Offset of the first box at `path` (e.g. [b"moov", b"trak", ...]) in an MP4; raises KeyError."""
    end = len(data) if end is None else end
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == path[0]:
            return pos if len(path) == 1 else _mp4_box(data, path[1:], pos + 8, pos + size)
        pos += size
    raise KeyError(path[0])


def mp4_declaring_frames(real: bytes, frames: int) -> bytes:
    """An MP4 from `real` (one track) whose sample tables claim `frames` samples of 100 bytes in one chunk:
    a few kB that make a demuxer build a `frames`-entry index, and a header whose duration lies."""
    data = bytearray(real)
    stbl = [b"moov", b"trak", b"mdia", b"minf", b"stbl"]
    stsz = _mp4_box(data, [*stbl, b"stsz"])
    data[stsz + 12 : stsz + 20] = struct.pack(">II", 100, frames)  # constant size, sample count
    stts = _mp4_box(data, [*stbl, b"stts"])
    data[stts + 16 : stts + 20] = struct.pack(">I", frames)  # first entry's count
    stsc = _mp4_box(data, [*stbl, b"stsc"])
    data[stsc + 20 : stsc + 24] = struct.pack(">I", frames)  # first entry's samples per chunk
    return bytes(data)


def mp4_declaring_size(real: bytes, w: int, h: int) -> bytes:
    """An MP4 from `real` whose visual sample entry (and track header) declare `w` x `h` pixels."""
    data = bytearray(real)
    stsd = _mp4_box(data, [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsd"])
    entry = stsd + 16  # size, kind, version/flags, entry count, then the first sample entry
    data[entry + 32 : entry + 36] = struct.pack(">HH", w, h)
    tkhd = _mp4_box(data, [b"moov", b"trak", b"tkhd"])
    tail = tkhd + struct.unpack(">I", data[tkhd : tkhd + 4])[0]
    data[tail - 8 : tail] = struct.pack(">II", w << 16, h << 16)
    return bytes(data)


def record_pixel_decodes(monkeypatch: Any) -> list[str | None]:
    """Record every PIL pixel decode from now on (the image's format per `ImageFile.load` call): a refusal
    "from the header" leaves the list empty, a real decode adds its format."""
    from PIL import ImageFile

    loads: list[str | None] = []
    real_load = ImageFile.ImageFile.load

    def recording_load(img: ImageFile.ImageFile) -> object:
        loads.append(img.format)
        return real_load(img)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    return loads
