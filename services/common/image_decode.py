"""Image decode for whoever encodes (the encoder, a co-located worker): one encoded image in, one RGB `PIL.Image` out.

Order: open through `services.common.media.open_image` (the router's header path, so the pixel,
frame and format limits are checked before any decode and both sides agree on the size),
optional reduced-scale JPEG decode, full `load()`, EXIF orientation, colour conversion.

Invariants:
- Without draft decoding the returned image's size equals the header's (width, height), which is
  what the router counted tokens from; a mismatch raises `MediaError` instead of a silent skew.
- Truncated or corrupt pixel data raises `MediaError` (reason `corrupt`), never a partial image:
  PIL's process-wide `ImageFile.LOAD_TRUNCATED_IMAGES` must stay False, and is checked.
- Animated images give their first frame (as `transformers.image_utils.load_image` does).

Colour rules (`to_rgb`): RGB is kept; anything with alpha (RGBA, LA, PA, or a palette/grayscale
image with a transparent colour) is composited on white, as the Idefics/Mllama processors do;
16-bit grayscale (I;16*, I) is scaled to 8 bits; L, 1, CMYK, YCbCr and opaque palettes use PIL's
`convert("RGB")`. Transformers' generic `convert_to_rgb` (Qwen2-VL, LLaVA) instead drops alpha
and clips 16-bit values, so exactness tests against it should use opaque 8-bit images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile

from services.common.media import (
    PIL_PARSE_ERRORS,
    ImageHeader,
    MediaError,
    MediaLimits,
    MediaReason,
    open_image,
)

# The same mapping as PIL.ImageOps.exif_transpose.
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_DRAFT_OVERSAMPLE = 2.0
"""Reduced-scale decode keeps at least this linear factor above the model's target size."""


@dataclass(frozen=True)
class DecodedImage:
    """A decoded image and the header it was checked against.

    `draft_factor` is 1 for a full decode; k > 1 when JPEG reduced-scale decoding produced an
    image about 1/k of the header size in each dimension. Token counts and resize targets must
    always come from `header` (what the router saw), never from `image.size`.
    """

    image: Image.Image
    header: ImageHeader
    draft_factor: int = 1


def load_image(data: bytes, limits: MediaLimits, target_pixels: int | None = None) -> Image.Image:
    """The RGB image for `data`; see `decode_image`."""
    return decode_image(data, limits, target_pixels=target_pixels).image


def decode_image(
    data: bytes, limits: MediaLimits, *, target_pixels: int | None = None, index: int | None = None
) -> DecodedImage:
    """Decode `data` fully to RGB with orientation applied, after the header checks.

    `target_pixels` (the model's max pixels) opts in to reduced-scale JPEG decoding: when the
    photo is much larger than the target (with `_DRAFT_OVERSAMPLE` linear margin), libjpeg decodes
    at 1/2, 1/4 or 1/8 scale, which is several times faster but gives different pixels from a full
    decode followed by the processor's resize. Leave it None (the default) wherever the output
    must equal transformers' exactly.
    """
    if target_pixels is not None and target_pixels < 1:
        raise ValueError(f"target_pixels must be positive or None, got {target_pixels}")
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True somewhere in this process; truncated "
            "images would decode silently. Leave it False."
        )
    opened = open_image(data, limits, index=index)
    img, header = opened.image, opened.header
    try:
        factor = _draft(img, header, target_pixels)
        try:
            img.load()
        except PIL_PARSE_ERRORS as exc:
            raise MediaError(f"truncated or corrupt pixel data ({exc})", MediaReason.CORRUPT, index=index) from None
        rgb = to_rgb(img, index=index)
        if header.orientation in _TRANSPOSE:
            rgb = rgb.transpose(_TRANSPOSE[header.orientation])
    except BaseException:
        img.close()
        raise
    if rgb is not img:  # closing drops the pixels too; a returned RGB original keeps them
        img.close()
    expected = (math.ceil(header.width / factor), math.ceil(header.height / factor))
    if rgb.size != expected:
        raise MediaError(
            f"decoded size {rgb.size[0]}x{rgb.size[1]} differs from the header's {expected[0]}x{expected[1]}",
            MediaReason.CORRUPT,
            index=index,
        )
    return DecodedImage(rgb, header, factor)


def _draft(img: ImageFile.ImageFile, header: ImageHeader, target_pixels: int | None) -> int:
    """Ask libjpeg for a reduced-scale decode when it pays; returns the reduction factor."""
    if target_pixels is None or header.format != "JPEG":
        return 1
    scale = math.sqrt(target_pixels / header.pixels) * _DRAFT_OVERSAMPLE
    if scale > 0.5:  # not even a 1/2 reduction would keep the margin
        return 1
    w, h = header.stored_size
    result = img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
    if result is None:
        return 1
    _, box = result  # (0, 0, width / scale, height / scale)
    return max(1, round(w / box[2]))


def to_rgb(img: Image.Image, *, index: int | None = None) -> Image.Image:
    """Convert a loaded image to 8-bit RGB by the module's colour rules."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _SIXTEEN_BIT_MODES:
        return Image.fromarray(_to_8bit(np.asarray(img)), "L").convert("RGB")
    try:
        if mode in _ALPHA_MODES or "transparency" in img.info:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img.convert("RGB")
    except ValueError:
        raise MediaError(f"unsupported colour mode '{mode}'", MediaReason.FORMAT, index=index) from None


def _to_8bit(samples: np.ndarray) -> np.ndarray:
    """16-bit samples (clipped to 0..65535) scaled to 0..255 with rounding."""
    wide = np.clip(samples.astype(np.int64), 0, 65535)
    return ((wide * 255 + 32767) // 65535).astype(np.uint8)
