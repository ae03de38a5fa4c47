"""Where a worker finds a request's embeddings: pushed by an encoder, or read from the cache.

Pushed embeddings go into the worker's in-process cache tier and wake the requests waiting
for them. `fetch` returns as soon as the embedding is local, polls the shared cache (another
worker's encoder may have filled it) and raises TimeoutError at the deadline, never later.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch

from services.common.embedding_cache import EmbeddingCache

POLL_S = 0.25


class EmbeddingStore:
    def __init__(self, cache: EmbeddingCache) -> None:
        self._cache = cache
        self._events: dict[str, asyncio.Event] = {}

    def put(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Keep a pushed embedding and wake its waiters (call on the event loop)."""
        self._cache.remember(mm_hash, tensor)
        event = self._events.pop(mm_hash, None)
        if event is not None:
            event.set()

    async def fetch(self, mm_hash: str, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        while True:
            event = self._events.setdefault(mm_hash, asyncio.Event())
            lookup = await asyncio.to_thread(self._cache.get, mm_hash)
            if lookup.tensor is not None:
                return lookup.tensor
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"embedding {mm_hash[:16]} not received within {timeout_s:.1f}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, POLL_S))
