"""An image processor's rescale and normalise of 8-bit pixels as one table lookup: transformers' two float passes,
bit for bit.

transformers' PIL-backend image processors rescale a resized ``uint8`` image in float64 (``x * scale``, then cast to
float32) and normalise it in float32 (``(x - mean) / std`` per channel): two passes and three temporaries over every
pixel (~2.7 ms of a 448x448 image's ~8.6 ms in the processor). Each output value depends only on the pixel's
8-bit value and its channel, so the same operations run once on the 256 values of each channel give a table, and
indexing it gives the same bits (element-wise IEEE operations round the same way wherever they run), in ~1 ms.
``install_pixel_table`` puts the pair on one processor instance, only after a probe of the whole processor
with and without it agrees exactly; anything else (another dtype, layout, scale, mean or std) takes the
processor's own methods.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

PROBE_SIZES = ((256, 192), (97, 61))
"""Images the probe runs through the processor with and without the table (width, height)."""


class _Normalised(np.ndarray):
    """A table lookup's result on its way from ``rescale`` to ``normalize`` (which returns it as a plain array)."""


class PixelTable:
    """``table[c, v]``: the processor's rescaled and normalised value of 8-bit value ``v`` in channel ``c``."""

    def __init__(self, processor: Any) -> None:
        self.scale = float(processor.rescale_factor)
        self.mean = list(np.atleast_1d(processor.image_mean))
        self.std = list(np.atleast_1d(processor.image_std))
        channels = len(self.mean)
        values = np.arange(256, dtype=np.uint8).reshape(1, 16, 16).repeat(channels, axis=0)  # channel-first
        table = processor.normalize(processor.rescale(values, self.scale), self.mean, self.std)
        self.table = np.ascontiguousarray(table.reshape(channels, 256))
        self._rescale = processor.rescale
        self._normalize = processor.normalize

    def rescale(self, image: np.ndarray, scale: float, **kwargs: Any) -> np.ndarray:
        """The processor's rescale, or for a channel-first ``uint8`` image at the table's scale, the table's values
        (rescaled and normalised at once), marked for ``normalize``."""
        channels = self.table.shape[0]
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[0] != channels or scale != self.scale or kwargs:
            return self._rescale(image, scale, **kwargs)
        out = np.empty(image.shape, dtype=self.table.dtype)
        for channel in range(channels):
            np.take(self.table[channel], image[channel], out=out[channel])
        return out.view(_Normalised)

    def normalize(self, image: np.ndarray, mean: Any, std: Any, **kwargs: Any) -> np.ndarray:
        """A table lookup's result as it is (it was normalised with the table's mean and std); else the processor's."""
        if isinstance(image, _Normalised):
            if list(np.atleast_1d(mean)) != self.mean or list(np.atleast_1d(std)) != self.std or kwargs:
                raise ValueError("pixel table: normalised with another mean or std than it was built with")
            return image.view(np.ndarray)
        return self._normalize(image, mean, std, **kwargs)


def install_pixel_table(processor: Any) -> bool:
    """Give ``processor`` (an image processor instance) the table's ``rescale`` and ``normalize`` when it rescales
    and normalises and its whole output on ``PROBE_SIZES`` random images is the same with the table as without;
    True when installed. A processor without those steps or methods is left as it is."""
    needed = ("rescale", "normalize", "rescale_factor", "image_mean", "image_std", "do_rescale", "do_normalize")
    if processor is None or not all(hasattr(processor, name) for name in needed):
        return False
    if not (processor.do_rescale and processor.do_normalize):
        return False
    try:
        table = PixelTable(processor)
        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in PROBE_SIZES]
        expected = [processor(images=[im], return_tensors="np")["pixel_values"] for im in images]
        processor.rescale, processor.normalize = table.rescale, table.normalize
        got = [processor(images=[im], return_tensors="np")["pixel_values"] for im in images]
    except Exception as exc:  # a processor whose steps look otherwise: keep its own
        log.info("pixel table not used: %s", exc)
        _restore(processor)
        return False
    if not all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(expected, got, strict=True)):
        log.warning("pixel table not used: the processor's output differs with it")
        _restore(processor)
        return False
    return True


def _restore(processor: Any) -> None:
    """Back to the class's own methods (the instance attributes removed)."""
    for name in ("rescale", "normalize"):
        processor.__dict__.pop(name, None)
