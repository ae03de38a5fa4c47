"""What the worker's engine holds of the embeddings it was handed: a repeated item is neither fetched nor sent again.

Invariant: a hash is here exactly while the engine keeps its embedding (`EmbeddingPool.kept` or pinned, provided
with ``keep``) because this ledger said so; the ledger alone forgets (least recently used first, past
``budget_bytes`` of the embeddings as the worker received them), and it tells the engine in the same order as it
provides, so an item found here is in the engine when a request admitted before the look-up needs it (the
engine's commands run in the order they were sent; an admitted request pins its items). Run on the worker's
event loop only.

Why: a repeated image's request cost the worker a cache read, a thread hop and a copy into shared memory, and the
engine process the mapping of that memory (~2.5 ms of CPU on a 2-core box for a 256 KB embedding), though the
engine had the same embedding from the request before, or did not even read it (the prefix cache held its tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import torch


class Provides(Protocol):
    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None: ...
    def forget_embedding(self, mm_hash: str) -> None: ...


class HeldEmbeddings:
    """The engine's kept embeddings by hash (LRU, at most ``budget_bytes``); every hand-over goes through `provide`."""

    def __init__(self, engine: Provides, budget_bytes: int) -> None:
        self._engine = engine
        self.budget_bytes = budget_bytes
        self._bytes: OrderedDict[str, int] = OrderedDict()
        self._total = 0

    def __contains__(self, mm_hash: object) -> bool:
        """Whether the engine holds it, its recency untouched."""
        return mm_hash in self._bytes

    def holds(self, mm_hash: str) -> bool:
        """True when the engine has this embedding (and it becomes the most recently used)."""
        if mm_hash not in self._bytes:
            return False
        self._bytes.move_to_end(mm_hash)
        return True

    def provide(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Hand the embedding to the engine unless it holds it; keep it there while the budget allows."""
        if self.holds(mm_hash):
            return
        keep = tensor.nbytes <= self.budget_bytes
        self._engine.provide_embedding(mm_hash, tensor, keep)
        if not keep:
            return
        self._bytes[mm_hash] = tensor.nbytes
        self._total += tensor.nbytes
        while self._total > self.budget_bytes:
            oldest, nbytes = self._bytes.popitem(last=False)
            self._total -= nbytes
            self._engine.forget_embedding(oldest)
