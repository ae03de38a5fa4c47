"""Moving step data between host and device: staged uploads, and the one counted door back to the host.

A step uploads its packed ints (and the sampler its few parameters) and downloads the sampled token ids;
nothing else crosses. On CUDA an upload goes through a pinned staging buffer with a non-blocking copy
(a copy from pageable memory blocks the host until the device has caught up); on the CPU it is the
host tensor itself, or one copy into a given static buffer.
"""

from __future__ import annotations

from array import array

import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


class _Stage:
    """A pinned buffer and the event of its last copy out."""

    def __init__(self, dtype: torch.dtype, size: int) -> None:
        self.buffer = torch.empty(size, dtype=dtype, pin_memory=True)
        self.event: torch.cuda.Event | None = None


class HostDevice:
    """Uploads to and downloads from ``device``.

    Invariant: the engine reads device values on the host only through ``to_host`` (counted in
    ``downloads``), so a step's host synchronisations can be counted. A staging buffer is refilled only
    after its previous copy finished (``waits`` counts those event waits; the step's download normally has
    already covered them, so they return at once).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.downloads = 0
        self.waits = 0
        self._staged = device.type == "cuda"
        self._stages: dict[torch.dtype, _Stage] = {}

    def upload(
        self, values: list[int] | list[float], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``values`` as a 1-D ``dtype`` tensor on the device; written into ``out[:len(values)]`` when given."""
        count = len(values)
        host = torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype) if count else torch.empty(0, dtype=dtype)
        if not self._staged:
            return host if out is None else out[:count].copy_(host)
        stage = self._stage(dtype, count)
        if stage.event is not None:
            self.waits += 1
            stage.event.synchronize()
        stage.buffer[:count].copy_(host)
        target = out[:count] if out is not None else torch.empty(count, dtype=dtype, device=self.device)
        target.copy_(stage.buffer[:count], non_blocking=True)
        stage.event = torch.cuda.Event()
        stage.event.record()
        return target

    def to_host(self, tensor: torch.Tensor) -> list:
        """``tensor.tolist()``: the one way device values reach the host."""
        self.downloads += 1
        return tensor.tolist()

    def _stage(self, dtype: torch.dtype, count: int) -> _Stage:
        stage = self._stages.get(dtype)
        if stage is None or stage.buffer.numel() < count:
            if stage is not None and stage.event is not None:
                stage.event.synchronize()
            stage = _Stage(dtype, max(count, 2 * (stage.buffer.numel() if stage else 4096)))
            self._stages[dtype] = stage
        return stage
