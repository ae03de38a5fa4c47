"""Value types shared by router and encoder media handling: limits, headers and refusals.

All are immutable and picklable (they cross into the encoder's process pool).
`services.common.media` re-exports every name here; import from there.
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


class MediaError(ValueError):
    """A media item the service refuses; always INVALID_ARGUMENT for the client.

    `reason` is the metric label, `detail` the human reason, `index` the item's position in the
    request when known (the message then starts with "image <index>: "). Picklable, so it crosses
    the encoder's process pool intact.
    """

    def __init__(self, detail: str, reason: MediaReason, *, index: int | None = None) -> None:
        self.detail = detail
        self.reason = MediaReason(reason)
        self.index = index
        super().__init__(detail if index is None else f"image {index}: {detail}")

    def with_index(self, index: int) -> MediaError:
        """The same refusal, labelled with the item's position in the request."""
        return MediaError(self.detail, self.reason, index=index)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_media_error, (self.detail, str(self.reason), self.index))


def _rebuild_media_error(detail: str, reason: str, index: int | None) -> MediaError:
    return MediaError(detail, MediaReason(reason), index=index)


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
