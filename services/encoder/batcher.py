"""Cross-request batching of vision-tower calls under an encoder-token budget.

Items (one media item each, already turned into the model's pixel inputs) wait in one FIFO queue.
A batch leaves when the queue holds at least `max_tokens` tokens or its oldest item has waited
`max_wait_s`; it takes items from the front while they fit in `max_tokens`, and runs as one call
of `encode` (the adapter's `encode(model, items)`) on the batcher's own thread.

Invariants:
- A batch's tokens never exceed `max_tokens`, except a batch of exactly one item that is larger
  than the budget by itself (it runs alone, never refused).
- One tower call at a time; batches leave in arrival order (no item is overtaken).
- An `mm_hash` queued or running is encoded once: a second `submit` returns the first's future.
- Every future `submit` returns resolves: with the embedding, with the exception of the call that
  encoded it, or with `BatcherClosed`. When a batch of several items fails, each item is retried
  alone, so one bad item fails only its own future.
- `queued_tokens` / `running_tokens` are exactly the tokens of the items waiting / in the tower.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.context import Context

from services.common.tracing import tracer

EncodeFn = Callable[[list[Any]], Sequence[torch.Tensor]]


class BatcherClosed(RuntimeError):
    """The batcher stopped before the item was encoded."""


@dataclass(frozen=True)
class BatchItem:
    """One item to encode: its identity, its cost in encoder tokens, and the model inputs."""

    mm_hash: str
    tokens: int
    inputs: Any


@dataclass(frozen=True)
class BatchStats:
    """One finished tower call, for metrics: items, tokens, seconds in `encode`, success."""

    items: int
    tokens: int
    seconds: float
    ok: bool


@dataclass
class _Queued:
    item: BatchItem
    future: asyncio.Future[torch.Tensor]
    enqueued_at: float = field(default_factory=time.monotonic)
    # the submitter's span (its request's `encode`): the batch's span links to it
    span_context: trace.SpanContext = field(default_factory=lambda: trace.get_current_span().get_span_context())


class Batcher:
    """See the module docstring. Create, `start()` inside the event loop, `await close()` at the end."""

    def __init__(
        self,
        encode: EncodeFn,
        max_tokens: int,
        max_wait_s: float,
        on_batch: Callable[[BatchStats], None] | None = None,
        thread_initializer: Callable[[], None] | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self._encode = encode
        self.max_tokens = max_tokens
        self.max_wait_s = max_wait_s
        self._on_batch = on_batch or (lambda stats: None)
        self._queue: deque[_Queued] = deque()
        self._by_hash: dict[str, asyncio.Future[torch.Tensor]] = {}
        self._queued_tokens = 0
        self._running_tokens = 0
        self._running: list[_Queued] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vision-tower", initializer=thread_initializer
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_items(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def running_tokens(self) -> int:
        return self._running_tokens

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="encoder-batcher")

    async def warm_up(self, inputs: list[Any]) -> None:
        """Run `encode` once on the tower thread (first-call costs paid before serving; no stats)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, inputs)

    def submit(self, item: BatchItem) -> asyncio.Future[torch.Tensor]:
        """Queue `item` (or join the same `mm_hash` already queued or running); call on the loop."""
        if self._task is None or self._task.done():
            raise BatcherClosed("the batcher is not running")
        existing = self._by_hash.get(item.mm_hash)
        if existing is not None:
            return existing
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._by_hash[item.mm_hash] = future
        self._queue.append(_Queued(item, future))
        self._queued_tokens += item.tokens
        self._wake.set()
        return future

    async def close(self) -> None:
        """Stop; fail every item not yet encoded with `BatcherClosed`."""
        pending = [*self._running, *self._queue]  # cancelling the task clears `_running`
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for entry in pending:
            self._finish(entry, error=BatcherClosed("the encoder is shutting down"))
        self._queue.clear()
        self._running = []
        self._queued_tokens = self._running_tokens = 0
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._fill()
            batch = self._take()
            await self._run_batch(batch)

    async def _fill(self) -> None:
        """Wait until the queue holds a full budget or its oldest item has waited long enough."""
        deadline = self._queue[0].enqueued_at + self.max_wait_s
        while self._queued_tokens < self.max_tokens:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)

    def _take(self) -> list[_Queued]:
        batch = [self._queue.popleft()]
        tokens = batch[0].item.tokens
        while self._queue and tokens + self._queue[0].item.tokens <= self.max_tokens:
            batch.append(self._queue.popleft())
            tokens += batch[-1].item.tokens
        self._queued_tokens -= tokens
        self._running_tokens = tokens
        self._running = batch
        return batch

    async def _run_batch(self, batch: list[_Queued]) -> None:
        try:
            try:
                results = await self._call(batch)
            except Exception as exc:
                if len(batch) == 1:
                    self._finish(batch[0], error=exc)
                    return
                for entry in batch:  # isolate the item that broke the batch
                    try:
                        self._finish(entry, tensor=(await self._call([entry]))[0])
                    except Exception as single:
                        self._finish(entry, error=single)
                return
            for entry, tensor in zip(batch, results, strict=True):
                self._finish(entry, tensor=tensor)
        finally:
            self._running_tokens = 0
            self._running = []

    async def _call(self, batch: list[_Queued]) -> Sequence[torch.Tensor]:
        inputs = [entry.item.inputs for entry in batch]
        tokens = sum(entry.item.tokens for entry in batch)
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        links = [trace.Link(entry.span_context) for entry in batch if entry.span_context.is_valid]
        attributes = {"epd.batch_size": len(batch), "epd.encoder_tokens": tokens}
        # one tower call serves several requests: its own span, linked to each item's `encode` span
        with tracer().start_as_current_span("encode.batch", context=Context(), links=links, attributes=attributes):
            try:
                results = await loop.run_in_executor(self._executor, self._encode, inputs)
                if len(results) != len(batch):
                    raise RuntimeError(f"encode returned {len(results)} embeddings for {len(batch)} items")
            except Exception:
                self._on_batch(BatchStats(len(batch), tokens, time.perf_counter() - start, ok=False))
                raise
        self._on_batch(BatchStats(len(batch), tokens, time.perf_counter() - start, ok=True))
        return results

    def _finish(
        self, entry: _Queued, *, tensor: torch.Tensor | None = None, error: BaseException | None = None
    ) -> None:
        self._by_hash.pop(entry.item.mm_hash, None)
        if entry.future.done():
            return
        if error is not None:
            entry.future.set_exception(error)
            entry.future.exception()  # retrieved: waiters re-raise it themselves
        else:
            entry.future.set_result(tensor)
