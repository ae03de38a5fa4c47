"""Moving step data between host and device: staged uploads, and the one counted door back to the host.

A step uploads its packed ints (and the sampler its few parameters) and downloads the sampled token ids;
nothing else crosses, but the embeddings that arrive between steps. On CUDA an upload goes through a
pinned staging buffer with a non-blocking copy (a copy from pageable memory waits for the device to catch
up with everything queued before it); on the CPU it is the host tensor itself, or one copy into a given
static buffer.
"""

from __future__ import annotations

import struct
from array import array

import numpy as np
import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}
_NUMPY_ARGMAX = (torch.float32, torch.float64)
RING = 4
"""Staging buffers per dtype, used in turn: a buffer is refilled four uploads after its last copy was queued."""


def _packed(values: list[int] | list[float], dtype: torch.dtype) -> bytearray | array:
    """``values`` as the bytes of a C array of ``dtype``: integers through `struct` (a step's ~2,000 ints in ~15 us,
    where ``array`` takes ~35), floats through ``array`` (which, unlike `struct`, rounds an out-of-range float to
    infinity as a cast does)."""
    code = _TYPECODES[dtype]
    if code == "f":
        return array(code, values)
    return bytearray(struct.pack(f"{len(values)}{code}", *values))


def packed_ints(values: list[int]) -> np.ndarray:
    """``values`` in a writable int64 numpy buffer (packed as ``upload`` packs them): a kept decode step's ints
    (services/worker/engine/decode_batch.py), which ``upload`` then takes without packing again."""
    return np.frombuffer(_packed(values, torch.int64), dtype=np.int64)


class _Stage:
    """A pinned buffer and the event of its last copy out."""

    def __init__(self, buffer: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        self.buffer = buffer
        self.event = event

    @classmethod
    def pinned(cls, dtype: torch.dtype, size: int) -> _Stage:
        return cls(torch.empty(size, dtype=dtype, pin_memory=True))

    def wait_free(self) -> bool:
        """Wait for the last copy out of the buffer if it is still in flight; True when that was a wait."""
        if self.event is None or self.event.query():
            return False
        self.event.synchronize()
        return True


class HostDevice:
    """Uploads to and downloads from ``device``.

    Invariant: the engine reads device values on the host only through ``to_host`` (counted in
    ``downloads``), so a step's host synchronisations can be counted. A staging buffer is refilled only
    after its previous copy finished: each dtype has a ring of ``RING`` buffers, so that copy was queued
    several uploads ago and is mostly done; ``waits`` counts the times it was not (the host waited).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.downloads = 0
        self.waits = 0
        self._staged = device.type == "cuda"
        self._cpu = device.type == "cpu"
        self._rings: dict[torch.dtype, list[_Stage | None]] = {}
        self._turn: dict[torch.dtype, int] = {}

    def upload(
        self, values: list[int] | list[float] | np.ndarray, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``values`` as a 1-D ``dtype`` tensor on the device; written into ``out[:len(values)]`` when given. A numpy
        array of ``dtype``'s type is taken as it is: on the CPU the tensor shares its memory."""
        count = len(values)
        if isinstance(values, np.ndarray):
            host = torch.from_numpy(values)
            if host.dtype != dtype:
                raise ValueError(f"upload of a {host.dtype} array as {dtype}")
        elif count:
            host = torch.frombuffer(_packed(values, dtype), dtype=dtype)
        else:
            host = torch.empty(0, dtype=dtype)
        if not self._staged:
            return host if out is None else out[:count].copy_(host)
        target = out[:count] if out is not None else torch.empty(count, dtype=dtype, device=self.device)
        return self._copy_staged(host, target)

    def to_device(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor (an embedding that arrived) on the device in ``dtype``, staged as uploads are."""
        tensor = tensor.to(dtype)
        if not self._staged or tensor.device.type != "cpu":
            return tensor.to(self.device)
        target = torch.empty(tensor.shape, dtype=dtype, device=self.device)
        self._copy_staged(tensor.reshape(-1), target.view(-1))
        return target

    def to_host(self, tensor: torch.Tensor) -> list:
        """``tensor.tolist()``: the one way device values reach the host."""
        self.downloads += 1
        return tensor.tolist()

    def argmax_to_host(self, logits: torch.Tensor) -> list[int]:
        """Each row's first maximal index of ``logits [N, vocab]`` (``torch.argmax``'s: ties to the lowest id, NaN
        counts as the maximum) on the host, counted as ``to_host``. On the CPU, float32 and float64 values are
        read once as numpy's (``numpy`` is then the one read) and numpy takes the argmax: the same index at ~10x
        less than torch's CPU argmax for a step's rows."""
        if self._cpu and logits.dtype in _NUMPY_ARGMAX and not logits.requires_grad:
            self.downloads += 1
            return logits.numpy().argmax(axis=-1).tolist()
        return self.to_host(logits.argmax(dim=-1))

    def _copy_staged(self, host: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        count = host.numel()
        stage = self._stage(host.dtype, count)
        stage.buffer[:count].copy_(host)
        target.copy_(stage.buffer[:count], non_blocking=True)
        stage.event = torch.cuda.Event()
        stage.event.record()
        return target

    def _stage(self, dtype: torch.dtype, count: int) -> _Stage:
        """The next buffer of ``dtype``'s ring, free (its last copy done) and holding ``count`` values."""
        ring = self._rings.setdefault(dtype, [None] * RING)
        turn = self._turn.get(dtype, 0)
        self._turn[dtype] = (turn + 1) % RING
        stage = ring[turn]
        if stage is not None and stage.wait_free():
            self.waits += 1
        if stage is None or stage.buffer.numel() < count:
            stage = ring[turn] = _Stage.pinned(dtype, max(count, 2 * (stage.buffer.numel() if stage else 4096)))
        return stage
