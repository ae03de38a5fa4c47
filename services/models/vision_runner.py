"""The vision tower runner (the encoder's, and a co-located worker's): RGB images in, embeddings out, a call per batch.

`prepare` (resize, normalise, patchify with the model's saved processor) is thread-safe and runs
on any thread; `run` runs the vision tower and projector over many items in one forward, calls
serialised by a lock (one batch launched at a time; on CUDA `run` returns once the work is queued).
A batch's embeddings stay where the tower made them (`VisionOutput`: the model's device, in the model's
dtype, in input order) and reach the host with one device-to-host copy for the whole batch, made on
first use (`host()`): a cache write or a gRPC push makes it, a torch.distributed push over NCCL sends
the device tensors and needs none. `encode_inputs` and `encode` return host tensors, as before.

Which attention the vision tower uses is chosen once, here, when a model is taken for encoding
(`install_vision_attention`: varlen on CUDA where the kernel runs and the adapter's tower has the packed path,
transformers' per-image SDPA on the CPU and for towers without it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import PIL.Image
import torch

from services.models.base import ModelAdapter, PixelInputs
from services.models.vision_attention import install_vision_attention


@dataclass(frozen=True)
class EncodedBatch:
    embeddings: list[torch.Tensor]
    seconds: float


class VisionOutput:
    """One tower call's embeddings on the model's device, and one host copy of all of them, made once on
    first use (thread-safe). Host tensors are contiguous views of one host buffer, in input order."""

    def __init__(self, embeddings: list[torch.Tensor]) -> None:
        self.on_device = [e.detach() for e in embeddings]
        self._host: list[torch.Tensor] | None = None
        self._lock = threading.Lock()

    def host(self) -> list[torch.Tensor]:
        """The embeddings on the host (for CPU models, the tensors themselves, made contiguous)."""
        with self._lock:
            if self._host is None:
                self._host = _to_host(self.on_device)
            return self._host

    def items(self) -> list[ItemEmbedding]:
        return [ItemEmbedding(tensor, self, index) for index, tensor in enumerate(self.on_device)]


@dataclass(frozen=True, eq=False)
class ItemEmbedding:
    """One item's embedding: ``tensor`` where it was made, ``host()`` its host copy (one copy per batch).

    An embedding that came from the host (a cache hit, another encoder's result) is `from_host`.
    """

    tensor: torch.Tensor
    _output: VisionOutput | None = None
    _index: int = 0

    @classmethod
    def from_host(cls, tensor: torch.Tensor) -> ItemEmbedding:
        return cls(tensor)

    def host(self) -> torch.Tensor:
        """The embedding on the host; the first call for any item of a batch copies the whole batch."""
        return self.tensor if self._output is None else self._output.host()[self._index]

    def for_device(self, device: torch.device) -> torch.Tensor:
        """What a transport that sends from ``device`` should get: the tensor as made when it lives there
        already (no copy), else the host copy (the transport moves it if it must)."""
        return self.tensor if same_device(self.tensor.device, device) else self.host()


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (``cuda`` without an index is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _to_host(embeddings: list[torch.Tensor]) -> list[torch.Tensor]:
    """One device-to-host copy of the whole batch, split back into items (views of one host tensor)."""
    if not embeddings or all(e.device.type == "cpu" for e in embeddings):
        return [e.contiguous() for e in embeddings]
    merged = _joined(embeddings)
    host = merged.cpu()
    return list(host.split([int(e.shape[0]) for e in embeddings]))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor ``parts`` tile in order (the adapter returns row splits of its merged output), viewed
    whole without a copy; their concatenation (a device-side copy) when they do not tile one."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        if (
            part.untyped_storage().data_ptr() != storage
            or part.dtype != first.dtype
            or part.shape[1:] != first.shape[1:]
            or not part.is_contiguous()
            or part.storage_offset() != offset
        ):
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(int(part.shape[0]) for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.contiguous().stride(), first.storage_offset())


class VisionRunner:
    """Runs the vision tower and projector of one loaded model.

    ``attention`` chooses the vision tower's attention once (``auto``, ``varlen`` or ``sdpa``; see
    services/models/vision_attention.py); ``self.attention`` is the path taken.
    """

    def __init__(self, adapter: ModelAdapter, model: torch.nn.Module, attention: str = "auto") -> None:
        self._adapter = adapter
        self._model = model
        self._lock = threading.Lock()
        self.attention = install_vision_attention(model, attention, packed=adapter.packed_vision_attention)

    def prepare(self, image: PIL.Image.Image) -> PixelInputs:
        """The model's pixel inputs for one RGB, already oriented image."""
        return self._adapter.preprocess(image)

    def run(self, inputs: list[PixelInputs]) -> VisionOutput:
        """One vision forward for `inputs`; the embeddings stay on the model's device."""
        with self._lock, torch.inference_mode():
            return VisionOutput(self._adapter.encode(self._model, inputs))

    def encode_items(self, inputs: list[PixelInputs]) -> list[ItemEmbedding]:
        """Per-item embeddings of one forward, in order (the batcher's call)."""
        return self.run(inputs).items()

    def encode_inputs(self, inputs: list[PixelInputs]) -> list[torch.Tensor]:
        """Embeddings for `inputs` on the host, in order, from a single vision forward."""
        return self.run(inputs).host()

    def encode(self, images: list[PIL.Image.Image]) -> EncodedBatch:
        """Prepare and encode `images` in one forward; host embeddings (tests, benchmarks, co-located
        encoding)."""
        inputs = [self.prepare(image) for image in images]
        start = time.perf_counter()
        embeddings = self.encode_inputs(inputs)
        return EncodedBatch(embeddings, time.perf_counter() - start)
