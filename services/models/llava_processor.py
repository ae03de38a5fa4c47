"""LLaVA-1.5's saved image processor described without pixels: the size it always outputs, its settings.

LLaVA folders save CLIPImageProcessor (llava-hf's LLaVA-1.5: shortest edge to 336, bicubic, center crop
336x336, CLIP mean/std) or LlavaImageProcessor (the same, and `do_pad`: the original LLaVA-1.5's pad to a
square of the mean colour before resizing). Both output one fixed size whatever the image, which is what makes
the token count a constant.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def output_size(image_processor: Any) -> tuple[int, int]:
    """(height, width) of every image the processor outputs: its crop, else a fixed (height, width) resize.

    Raises ValueError when the output size depends on the image (no crop and a shortest-edge resize, or none).
    """
    ip = image_processor
    if ip.do_center_crop:
        return int(ip.crop_size.height), int(ip.crop_size.width)
    if ip.do_resize and ip.size.height and ip.size.width:
        return int(ip.size.height), int(ip.size.width)
    raise ValueError("the image processor's output size depends on the image (no center crop, no fixed resize)")


def processor_settings(image_processor: Any) -> dict[str, Any]:
    """Canonical JSON-able dict of every setting that changes the processor's output (for `mm_hash`)."""
    ip = image_processor
    return {
        "image_processor_type": type(ip).__name__.removesuffix("Pil"),
        "do_convert_rgb": bool(ip.do_convert_rgb),
        "do_pad": bool(getattr(ip, "do_pad", False)),
        "do_resize": bool(ip.do_resize),
        "size": _size(ip.size),
        "default_to_square": bool(getattr(ip, "default_to_square", True)),
        "resample": int(ip.resample),
        "do_center_crop": bool(ip.do_center_crop),
        "crop_size": _size(ip.crop_size),
        "do_rescale": bool(ip.do_rescale),
        "rescale_factor": float(ip.rescale_factor),
        "do_normalize": bool(ip.do_normalize),
        "image_mean": [float(v) for v in ip.image_mean],
        "image_std": [float(v) for v in ip.image_std],
    }


def _size(size: Any) -> dict[str, int]:
    """A processor's SizeDict as a plain dict of its set fields."""
    return {key: int(value) for key, value in sorted(dataclasses.asdict(size).items()) if value is not None}
