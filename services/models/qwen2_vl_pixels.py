"""Qwen2-VL-family image pixels in one pass: the pixel table's values gathered straight into the patch rows.

The saved processor (transformers' PIL backend) turns an RGB image into rows of patches in four passes over
its pixels: the image to a channel-first array, the resize, rescale and normalise (one table lookup with
services/models/pixel_table.py), then ``patchify`` (a transposed copy that also repeats each frame
``temporal_patch_size`` times); a 448 x 448 image took ~10 ms, most of it copies. `ImagePixels` resizes with
PIL as the processor does (none when the image already has the resize rule's size), views the 8-bit pixels in
patch order and looks each one up in the table once, writing float32 rows of the processor's layout: the same
bits in ~1.7 ms. ``probe_image_pixels`` builds one only where the processor's own output on probe images of
several sizes (resized and not) is equal to it, bit for bit; anything else keeps the processor.

Row layout (``patchify``'s): rows in (gh / merge, gw / merge, merge, merge) order, each row (channel, temporal,
patch, patch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from services.models.pixel_table import PixelTable

log = logging.getLogger(__name__)

PROBE_SIZES = ((56, 56), (97, 61), (130, 230))
"""(width, height) of the probe's random images: one the resize rule keeps, two it resizes."""


class ImagePixels:
    """``pixels(image, height, width)``: the processor's pixel rows of one RGB image resized to (height, width)."""

    def __init__(self, table: np.ndarray, patch: int, merge: int, temporal: int, resample: int) -> None:
        self.table = np.ascontiguousarray(table, dtype=np.float32)  # [channels, 256]
        self.patch, self.merge, self.temporal, self.resample = patch, merge, temporal, resample

    def __call__(self, image: Image.Image, height: int, width: int) -> np.ndarray:
        """``[grid_h * grid_w, channels * temporal * patch * patch]`` float32 (height and width: multiples of
        patch * merge, as the resize rule gives them)."""
        if (image.height, image.width) != (height, width):
            image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image)  # [height, width, channels] uint8
        p, m, channels = self.patch, self.merge, self.table.shape[0]
        gh, gw = height // p, width // p
        view = pixels.reshape(gh // m, m, p, gw // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
        rows = np.empty((gh // m, gw // m, m, m, channels, self.temporal, p, p), dtype=np.float32)
        for channel in range(channels):
            rows[:, :, :, :, channel, 0] = self.table[channel][view[:, :, :, :, channel]]
        rows[:, :, :, :, :, 1:] = rows[:, :, :, :, :, :1]  # each frame repeated along the temporal patch
        return rows.reshape(gh * gw, channels * self.temporal * p * p)


def probe_image_pixels(
    processor: Any, patch: int, merge: int, temporal: int, grid: Callable[[int, int], tuple[int, int, int]]
) -> ImagePixels | None:
    """An `ImagePixels` for ``processor`` when it resizes, rescales and normalises, and its pixel values and grid
    on ``PROBE_SIZES`` random RGB images equal the one-pass rows (``grid(width, height)``: the resize rule's
    (1, grid_h, grid_w)); else None, and the processor stays in use."""
    steps = ("do_resize", "do_rescale", "do_normalize")
    if processor is None or not all(getattr(processor, name, False) for name in steps):
        return None
    try:
        pixels = ImagePixels(PixelTable(processor).table, patch, merge, temporal, int(processor.resample))
        rng = np.random.default_rng(0)
        for width, height in PROBE_SIZES:
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            expected = processor(images=[image], return_tensors="np")
            _, gh, gw = grid(width, height)
            got = pixels(image, gh * patch, gw * patch)
            same_grid = [int(v) for v in expected["image_grid_thw"][0]] == [1, gh, gw]
            values = expected["pixel_values"]
            if not (same_grid and values.dtype == got.dtype and np.array_equal(values, got)):
                log.warning("one-pass image pixels not used: the processor's output differs at %dx%d", width, height)
                return None
    except Exception as exc:  # a processor whose settings or steps look otherwise: keep it
        log.info("one-pass image pixels not used: %s", exc)
        return None
    return pixels
