"""Value types shared by router and encoder media handling: limits, headers and refusals.

All are immutable and picklable (they cross into the encoder's process pool).
`services.common.media` re-exports the image names; video code (`services.common.video`, the encoder's
pool children) imports `VideoLimits` and `VideoHeader` from here, without PIL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

SUPPORTED_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"})
"""Formats `services.common.media` can open; TIFF is off by default (large libtiff surface)."""
DEFAULT_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP"})


class MediaReason(StrEnum):
    """Short machine reason for a refusal, used as a metric label."""

    EMPTY = "empty"
    CORRUPT = "corrupt"
    FORMAT = "format"
    PIXELS = "pixels"
    FRAMES = "frames"
    ENCODING = "encoding"
    BYTES = "bytes"
    DURATION = "duration"
    TIMEOUT = "timeout"


class MediaError(ValueError):
    """A media item the service refuses; always INVALID_ARGUMENT for the client.

    `reason` is the metric label, `detail` the human reason, `index` the item's position in the
    request when known (the message then starts with "<media> <index>: ", media "image" or "video").
    Picklable, so it crosses the encoder's process pool intact.
    """

    def __init__(self, detail: str, reason: MediaReason, *, index: int | None = None, media: str = "image") -> None:
        self.detail = detail
        self.reason = MediaReason(reason)
        self.index = index
        self.media = media
        super().__init__(detail if index is None else f"{media} {index}: {detail}")

    def with_index(self, index: int) -> MediaError:
        """The same refusal, labelled with the item's position in the request."""
        return MediaError(self.detail, self.reason, index=index, media=self.media)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_media_error, (self.detail, str(self.reason), self.index, self.media))


def _rebuild_media_error(detail: str, reason: str, index: int | None, media: str = "image") -> MediaError:
    return MediaError(detail, MediaReason(reason), index=index, media=media)


@dataclass(frozen=True)
class MediaLimits:
    """Per-item decode limits; validated on construction. Picklable (sent to pool children)."""

    max_pixels: int = 50_000_000
    max_frames: int = 1_000
    allowed_formats: frozenset[str] = field(default=DEFAULT_FORMATS)

    def __post_init__(self) -> None:
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ValueError(f"max_pixels must be a positive int, got {self.max_pixels!r}")
        if not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"max_frames must be a positive int, got {self.max_frames!r}")
        formats = frozenset(f.upper() for f in self.allowed_formats)
        if not formats or formats - SUPPORTED_FORMATS:
            raise ValueError(
                f"allowed_formats must be a non-empty subset of {sorted(SUPPORTED_FORMATS)}, "
                f"got {sorted(self.allowed_formats)}"
            )
        object.__setattr__(self, "allowed_formats", formats)


@dataclass(frozen=True)
class ImageHeader:
    """What the header says. `width` x `height` is the displayed size, after EXIF orientation
    (orientations 5-8 swap the stored dimensions); `orientation` is 1-8 (1 when absent/invalid)."""

    format: str
    width: int
    height: int
    frames: int
    orientation: int

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def stored_size(self) -> tuple[int, int]:
        """(width, height) as stored in the file, before orientation."""
        swap = self.orientation >= 5
        return (self.height, self.width) if swap else (self.width, self.height)


@dataclass(frozen=True)
class VideoLimits:
    """Per-video limits, checked from the container header before any frame is decoded (and again by the
    encoder while decoding). Validated on construction; picklable.

    `max_frames` bounds the frames the stream holds (decoding walks all of them up to the last sampled
    one); `max_track_samples` bounds every track's sample table (audio included), which a demuxer indexes
    at open: `max(max_frames, 100 x max_seconds)`.
    """

    max_frame_pixels: int = 3840 * 2160
    max_frames: int = 36_000
    max_seconds: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_frame_pixels", "max_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds!r}")

    @property
    def max_track_samples(self) -> int:
        return max(self.max_frames, int(100 * self.max_seconds))


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container header says about its first video stream.

    `frames` is the stream's frame count from the header, or, where the container stores none (WebM),
    `round(duration x fps)` with `frames_estimated` set; `duration_s` is `frames / fps` (what the frame
    sampling sees). `codec` is FFmpeg's decoder name.
    """

    format: str
    codec: str
    width: int
    height: int
    frames: int
    fps: float
    frames_estimated: bool = False

    @property
    def duration_s(self) -> float:
        return self.frames / self.fps

    @property
    def pixels(self) -> int:
        return self.width * self.height
