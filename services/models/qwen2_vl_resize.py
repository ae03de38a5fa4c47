"""Qwen2-VL's image resize rule, as a pure function (no processor, no pixels).

The router counts image tokens with it from the image header alone; the encoder's processor applies
the same rule to the pixels. A test proves it equal to transformers' own `smart_resize`.
"""

from __future__ import annotations

import math

from services.models.base import ImageSizeError

_MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: (height, width) rounded to multiples of `factor`, area in [min, max] pixels.

    Mirrors transformers' `smart_resize` exactly (including Python's round-half-to-even).
    Raises ImageSizeError for an empty image or an aspect ratio over 200.
    """
    if height < 1 or width < 1:
        raise ImageSizeError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ImageSizeError(f"image aspect ratio of {width}x{height} exceeds {_MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
