"""The encoder's model side: RGB images in, projected embeddings out, one tower call per batch."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import PIL.Image
import torch

from services.models.base import ModelAdapter


@dataclass(frozen=True)
class EncodedBatch:
    embeddings: list[torch.Tensor]
    seconds: float


class VisionRunner:
    """Runs the vision tower and projector; calls are serialised (one batch on the device at a time)."""

    def __init__(self, adapter: ModelAdapter, model: torch.nn.Module) -> None:
        self._adapter = adapter
        self._model = model
        self._lock = threading.Lock()

    def encode(self, images: list[PIL.Image.Image]) -> EncodedBatch:
        """Embeddings for `images`, in order, from a single vision forward."""
        inputs = [self._adapter.preprocess(image) for image in images]
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            embeddings = self._adapter.encode(self._model, inputs)
            seconds = time.perf_counter() - start
        return EncodedBatch([e.detach().to("cpu").contiguous() for e in embeddings], seconds)
