"""What an admitted request waits for besides the engine: its embeddings (a fetch per item) and a remote prefill's KV.

Invariants: each media item is fetched once (pushed or from the cache) and handed to the engine as it arrives; the
first fetch that times out, or a receiving request's KV deadline, puts a `FetchFailed` on the request's output
queue (services/worker/stream_ends.py: it then ends DEADLINE_EXCEEDED and frees its blocks); `cancel` stops every
task, so nothing outlives the request's stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import torch

from services.worker.embedding_store import EmbeddingStore
from services.worker.stream_ends import FetchFailed


class EmbeddingFetches:
    """One task per item fetching its embedding within `timeout_s` and passing it to `provide`; the wait of each
    is recorded by `record_wait`; a timeout puts a FetchFailed on `outputs`."""

    def __init__(
        self,
        mm_hashes: Iterable[str],
        store: EmbeddingStore,
        provide: Callable[[str, torch.Tensor], object],
        record_wait: Callable[[float], None],
        outputs: asyncio.Queue,
        timeout_s: float,
    ) -> None:
        self._store, self._provide, self._record_wait = store, provide, record_wait
        self._tasks = [asyncio.create_task(self._fetch(mm_hash, timeout_s)) for mm_hash in mm_hashes]
        self._left = len(self._tasks)
        self._last_at = 0.0
        for task in self._tasks:
            task.add_done_callback(self._done)
        self._watcher = asyncio.create_task(self._watch(outputs))

    async def _fetch(self, mm_hash: str, timeout_s: float) -> None:
        start = time.perf_counter()
        tensor = await self._store.fetch(mm_hash, timeout_s)
        self._record_wait(time.perf_counter() - start)
        self._provide(mm_hash, tensor)

    async def _watch(self, outputs: asyncio.Queue) -> None:
        for task in asyncio.as_completed(self._tasks):
            try:
                await task
            except TimeoutError as exc:
                outputs.put_nowait(FetchFailed(str(exc)))
                return

    def _done(self, task: asyncio.Task) -> None:
        self._left -= 1
        self._last_at = max(self._last_at, time.perf_counter())

    def seconds_after(self, since: float) -> float:
        """Seconds from `since` (perf_counter) until the last embedding arrived; 0 while any is awaited or when the
        request had none (the first response's `encode_wait_s`)."""
        return max(0.0, self._last_at - since) if self._left == 0 and self._last_at else 0.0

    def cancel(self) -> None:
        """Stop the fetches and their watcher (the request's stream ended)."""
        self._watcher.cancel()
        for task in self._tasks:
            task.cancel()


async def kv_deadline(outputs: asyncio.Queue, timeout_s: float) -> None:
    """Put a FetchFailed on a receiving request's queue when its KV has not all arrived within ``timeout_s`` (the
    request then ends DEADLINE_EXCEEDED, its blocks freed; its router re-admits it; late chunks are dropped)."""
    await asyncio.sleep(timeout_s)
    outputs.put_nowait(FetchFailed(f"the remote prefill's KV did not arrive within {timeout_s:g}s"))
