"""Media embeddings held by the engine for the requests that need them."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.worker.engine.host_device import HostDevice


@dataclass(frozen=True)
class EmbeddingStats:
    pinned: int
    buffered: int
    buffered_bytes: int


class EmbeddingPool:
    """Embeddings by ``mm_hash``, pinned while a live request needs them.

    Invariant: ``refs[h]`` is the number of media items of live requests with hash ``h`` (absent when
    zero); an embedding is in ``pinned`` only while ``refs`` holds its hash, and dropped when the last
    such request finishes or is aborted. One that arrives before any request needs it waits in
    ``buffered`` (LRU, at most ``buffer_bytes``) and moves to ``pinned`` when a request claims it; no
    hash is in both.
    """

    def __init__(self, buffer_bytes: int, dtype: torch.dtype, io: HostDevice) -> None:
        self.buffer_bytes = buffer_bytes
        self.dtype = dtype
        self.io = io
        self.refs: dict[str, int] = {}
        self.pinned: dict[str, torch.Tensor] = {}
        self.buffered: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._buffered_bytes = 0

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self.pinned

    def get(self, mm_hash: str) -> torch.Tensor:
        return self.pinned[mm_hash]

    def peek(self, mm_hash: str) -> torch.Tensor | None:
        """The embedding if it has arrived (pinned or buffered), else None."""
        return self.pinned.get(mm_hash, self.buffered.get(mm_hash))

    def provide(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Keep an arrived embedding: pinned if a request needs it, else buffered."""
        tensor = self.io.to_device(tensor, self.dtype)  # staged: an arriving embedding never waits for a step
        if mm_hash in self.refs:
            self.pinned[mm_hash] = tensor
            return
        self._unbuffer(mm_hash)
        if tensor.nbytes > self.buffer_bytes:
            return
        self.buffered[mm_hash] = tensor
        self._buffered_bytes += tensor.nbytes
        while self._buffered_bytes > self.buffer_bytes:
            self._unbuffer(next(iter(self.buffered)))

    def acquire(self, mm_hashes: list[str]) -> None:
        """A new request needs these items (one entry per item)."""
        for mm_hash in mm_hashes:
            self.refs[mm_hash] = self.refs.get(mm_hash, 0) + 1
            tensor = self._unbuffer(mm_hash)
            if tensor is not None:
                self.pinned[mm_hash] = tensor

    def release(self, mm_hashes: list[str]) -> None:
        """A request that needed these items is gone; drop what nobody needs any more."""
        for mm_hash in mm_hashes:
            count = self.refs.get(mm_hash, 0) - 1
            if count < 0:
                raise RuntimeError(f"embedding {mm_hash[:16]} released more often than acquired")
            if count == 0:
                del self.refs[mm_hash]
                self.pinned.pop(mm_hash, None)
            else:
                self.refs[mm_hash] = count

    def stats(self) -> EmbeddingStats:
        return EmbeddingStats(len(self.pinned), len(self.buffered), self._buffered_bytes)

    def _unbuffer(self, mm_hash: str) -> torch.Tensor | None:
        tensor = self.buffered.pop(mm_hash, None)
        if tensor is not None:
            self._buffered_bytes -= tensor.nbytes
        return tensor
