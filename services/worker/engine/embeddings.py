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
    zero); an embedding is in ``pinned`` only while ``refs`` holds its hash. One no live request needs is
    in ``kept`` while its provider holds it there (``provide(..., keep=True)`` until ``forget``: the worker's
    `HeldEmbeddings` decides, so it knows without asking what the engine has), else in ``buffered`` (LRU,
    at most ``buffer_bytes``) or dropped; a claimed one moves to ``pinned`` and back when its last request
    finishes or is aborted. No hash is in two of the three.
    """

    def __init__(self, buffer_bytes: int, dtype: torch.dtype, io: HostDevice) -> None:
        self.buffer_bytes = buffer_bytes
        self.dtype = dtype
        self.io = io
        self.refs: dict[str, int] = {}
        self.pinned: dict[str, torch.Tensor] = {}
        self.buffered: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.kept: dict[str, torch.Tensor] = {}
        self.held: set[str] = set()  # what the provider keeps here (pinned or kept) until it forgets it
        self._buffered_bytes = 0

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self.pinned

    def get(self, mm_hash: str) -> torch.Tensor:
        return self.pinned[mm_hash]

    def peek(self, mm_hash: str) -> torch.Tensor | None:
        """The embedding if it has arrived (pinned, kept or buffered), else None."""
        for tensors in (self.pinned, self.kept, self.buffered):
            if mm_hash in tensors:
                return tensors[mm_hash]
        return None

    def provide(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None:
        """Keep an arrived embedding: pinned if a request needs it, else kept (``keep``: until ``forget``) or
        buffered."""
        tensor = self.io.to_device(tensor, self.dtype)  # staged: an arriving embedding never waits for a step
        if keep:
            self.held.add(mm_hash)
        if mm_hash in self.refs:
            self.pinned[mm_hash] = tensor
            return
        self._unbuffer(mm_hash)
        if mm_hash in self.held:
            self.kept[mm_hash] = tensor
            return
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
            if tensor is None:
                tensor = self.kept.pop(mm_hash, None)
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
                tensor = self.pinned.pop(mm_hash, None)
                if tensor is not None and mm_hash in self.held:
                    self.kept[mm_hash] = tensor
            else:
                self.refs[mm_hash] = count

    def forget(self, mm_hash: str) -> None:
        """The provider no longer keeps this embedding here: dropped now, or when its last request ends."""
        self.held.discard(mm_hash)
        self.kept.pop(mm_hash, None)

    def stats(self) -> EmbeddingStats:
        """Pinned embeddings; buffered ones counting the kept (nothing a request holds)."""
        kept_bytes = sum(tensor.nbytes for tensor in self.kept.values())
        return EmbeddingStats(len(self.pinned), len(self.buffered) + len(self.kept), self._buffered_bytes + kept_bytes)

    def _unbuffer(self, mm_hash: str) -> torch.Tensor | None:
        tensor = self.buffered.pop(mm_hash, None)
        if tensor is not None:
            self._buffered_bytes -= tensor.nbytes
        return tensor
