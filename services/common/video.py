"""Video headers for the router and the encoder: container, codec, size, frame count, frame rate; never pixels.

`probe_video` reads only what a demuxer reads to open a file, so the router learns how many frames a
video holds, at what rate and size, and counts its tokens before anything is decoded; refusals cost
milliseconds and no frame memory. The encoder opens videos through `open_video`, the same path, so both
sides read the same header. Frame count and rate are read as transformers' PyAV reader reads them
(`stream.frames`, `stream.average_rate`); a container that stores no frame count (WebM) gets
`round(duration x rate)`, marked `frames_estimated`.

Bounds, in order: the magic bytes name a container we open (MP4/MOV, Matroska/WebM; the demuxer is
forced to it, never guessed); an MP4's sample tables are walked first (`video_bytes`) and refused when a
track claims more samples than `VideoLimits.max_track_samples`, since the demuxer would index them all
while opening; then FFmpeg opens the bytes from memory with a 1 MiB probe, a 1 s analysis window and
every decoder capped at `max_frame_pixels` (its `max_pixels`), so stream probing cannot decode a frame
larger than the limit. Only listed codecs are accepted.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from services.common.media_types import MediaError, MediaReason, VideoHeader, VideoLimits
from services.common.video_bytes import mp4_track_samples, sniff_container

CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4"})
"""Decoders (FFmpeg names) a video stream may need."""
_FORMATS = {"mp4": "mov", "matroska": "matroska"}  # our name -> FFmpeg's demuxer
_PROBE = {"probesize": str(1 << 20), "analyzeduration": "1000000"}
_MAX_FPS = 1000.0


def warm_up() -> None:
    """Load PyAV and FFmpeg now (tens of milliseconds, once), so the first video's refusal does not pay it."""
    import av  # noqa: F401


def probe_video(data: bytes, limits: VideoLimits, *, index: int | None = None) -> VideoHeader:
    """Read a video's header and enforce `limits`; never decodes a frame beyond what opening needs.

    Raises `MediaError` with reason `empty`, `format` (not a container we open, no video stream, a
    codec not accepted), `corrupt`, `pixels`, `frames` or `duration`.
    """
    with open_video(data, limits, index=index) as (_, header):
        return header


@contextmanager
def open_video(data: bytes, limits: VideoLimits, *, index: int | None = None) -> Iterator[tuple[Any, VideoHeader]]:
    """`probe_video`, keeping the opened PyAV container (first video stream: `container.streams.video[0]`)
    for the encoder to decode from; closed on exit."""
    import av  # here: the router's import of this module stays cheap until a video arrives

    try:
        kind, container = _open(av, data, limits)
    except MediaError as exc:
        raise exc if index is None else exc.with_index(index) from None
    try:
        header = _header(container, limits, kind)
    except MediaError as exc:
        container.close()
        raise exc if index is None else exc.with_index(index) from None
    except BaseException:
        container.close()
        raise
    try:
        yield container, header
    finally:
        container.close()


def _open(av: Any, data: bytes, limits: VideoLimits) -> tuple[str, Any]:
    if not data:
        raise _error("empty data", MediaReason.EMPTY)
    kind = sniff_container(data)
    if kind is None:
        raise _error("not a video container we accept (MP4/MOV, WebM/Matroska)", MediaReason.FORMAT)
    if kind == "mp4":
        counts = mp4_track_samples(data)
        if counts is None:
            raise _error("malformed MP4 box structure", MediaReason.CORRUPT)
        if counts and max(counts.values()) > limits.max_track_samples:
            raise _error(
                f"a track claims {max(counts.values())} samples, above the {limits.max_track_samples} limit",
                MediaReason.FRAMES,
            )
    options = {**_PROBE, "max_pixels": str(limits.max_frame_pixels)}
    try:
        return kind, av.open(io.BytesIO(data), format=_FORMATS[kind], options=options)
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        raise _error(f"truncated or corrupt container ({_short(exc)})", MediaReason.CORRUPT) from None


def _header(container: Any, limits: VideoLimits, kind: str) -> VideoHeader:
    streams = container.streams.video
    if not streams:
        raise _error("the container holds no video stream (audio only?)", MediaReason.FORMAT)
    stream = streams[0]
    context = stream.codec_context
    codec = context.name if context is not None else "none"
    if codec not in CODECS:
        raise _error(f"unsupported video codec '{codec}'", MediaReason.FORMAT)
    width, height = int(stream.width or 0), int(stream.height or 0)
    if width < 1 or height < 1:  # also what probing leaves when the decoder refused a frame over max_pixels
        raise _error(
            f"the video stream has no usable size ({width}x{height}): corrupt, or frames above the "
            f"{limits.max_frame_pixels}-pixel limit",
            MediaReason.CORRUPT,
        )
    if width * height > limits.max_frame_pixels:
        raise _error(
            f"frames are {width}x{height}, above the {limits.max_frame_pixels}-pixel limit", MediaReason.PIXELS
        )
    rate = stream.average_rate
    fps = float(rate) if rate else 0.0
    if not 0 < fps <= _MAX_FPS:
        raise _error(f"the video stream has no usable frame rate ({fps})", MediaReason.CORRUPT)
    frames, estimated = int(stream.frames or 0), False
    if frames <= 0:
        frames, estimated = _frames_from_duration(container, stream, fps), True
    if frames <= 0:
        raise _error("the container states neither a frame count nor a duration", MediaReason.CORRUPT)
    if frames / fps > limits.max_seconds:
        raise _error(
            f"the video lasts {frames / fps:.1f}s, above the {limits.max_seconds:g}s limit", MediaReason.DURATION
        )
    if frames > limits.max_frames:
        raise _error(f"the video holds {frames} frames, above the {limits.max_frames} limit", MediaReason.FRAMES)
    return VideoHeader(kind, codec, width, height, frames, fps, estimated)


def _frames_from_duration(container: Any, stream: Any, fps: float) -> int:
    """round(duration x fps), from the stream's duration or else the container's; 0 when neither is known."""
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000
    else:
        return 0
    return round(seconds * fps) if math.isfinite(seconds) and seconds > 0 else 0


def _short(exc: BaseException) -> str:
    text = (getattr(exc, "strerror", None) or str(exc)).strip() or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _error(detail: str, reason: MediaReason) -> MediaError:
    return MediaError(detail, reason, media="video")
