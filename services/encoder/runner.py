"""The encoder's model side: RGB images in, projected embeddings out, one tower call per batch.

`prepare` (resize, normalise, patchify with the model's saved processor) is thread-safe and runs
on any thread; `encode_inputs` runs the vision tower and projector over many items in one forward,
calls serialised by a lock (one batch on the device at a time). Embeddings come back on the CPU,
contiguous, in the model's dtype, in the order of the inputs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import PIL.Image
import torch

from services.models.base import ModelAdapter, PixelInputs


@dataclass(frozen=True)
class EncodedBatch:
    embeddings: list[torch.Tensor]
    seconds: float


class VisionRunner:
    """Runs the vision tower and projector of one loaded model."""

    def __init__(self, adapter: ModelAdapter, model: torch.nn.Module) -> None:
        self._adapter = adapter
        self._model = model
        self._lock = threading.Lock()

    def prepare(self, image: PIL.Image.Image) -> PixelInputs:
        """The model's pixel inputs for one RGB, already oriented image."""
        return self._adapter.preprocess(image)

    def encode_inputs(self, inputs: list[PixelInputs]) -> list[torch.Tensor]:
        """Embeddings for `inputs`, in order, from a single vision forward."""
        with self._lock, torch.inference_mode():
            embeddings = self._adapter.encode(self._model, inputs)
        return [e.detach().to("cpu").contiguous() for e in embeddings]

    def encode(self, images: list[PIL.Image.Image]) -> EncodedBatch:
        """Prepare and encode `images` in one forward (tests and benchmarks)."""
        inputs = [self.prepare(image) for image in images]
        start = time.perf_counter()
        embeddings = self.encode_inputs(inputs)
        return EncodedBatch(embeddings, time.perf_counter() - start)
