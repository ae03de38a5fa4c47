"""Admission: a request is placed only where its projected tokens' KV blocks are reserved.

Policy, in order: no live worker -> UNAVAILABLE (after waiting up to the queue deadline for one
to register); more blocks than any worker could ever hold -> FAILED_PRECONDITION; no worker with
enough unreserved blocks in the router's view -> RESOURCE_EXHAUSTED at once (a request cannot
span workers, so the cluster's total is not the test). Otherwise the ranked workers are asked in
turn (the worker decides atomically); when all refuse (the view was stale: another router got
there first), the request waits in a bounded queue until the view changes or its wait deadline,
then gets RESOURCE_EXHAUSTED with `retry-after-ms`. Invariant: `waiting`
never exceeds `queue_size`, so overload turns into fast refusals, not growing latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from services.router.cluster_view import ClusterView, WorkerView
from services.router.errors import RequestError, unavailable
from services.router.placement import PrefixAffinity, rank_workers

T = TypeVar("T")


@dataclass(frozen=True)
class AdmissionSettings:
    queue_size: int = 64
    max_wait_s: float = 2.0
    retry_after_ms: int = 500
    affinity_weight: float = 1.0


@dataclass(frozen=True)
class Reserved(Generic[T]):
    """A worker's yes: the caller's handle on the request there, and the worker's clock at reserving."""

    handle: T
    at: float


@dataclass(frozen=True)
class Admitted(Generic[T]):
    worker: str
    blocks: int
    handle: T
    queue_s: float


class Rejection(RequestError):
    """An admission refusal; `reason` labels the metric."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str, retry_after_ms: int | None = None):
        metadata = (("retry-after-ms", str(retry_after_ms)),) if retry_after_ms is not None else ()
        super().__init__(code, message, metadata)
        self.reason = reason


class Admission:
    def __init__(self, view: ClusterView, affinity: PrefixAffinity, settings: AdmissionSettings) -> None:
        self._view = view
        self._affinity = affinity
        self._settings = settings
        self.waiting = 0

    def _exhausted(self, message: str, reason: str) -> Rejection:
        return Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason, self._settings.retry_after_ms)

    def block_size(self) -> int:
        """The workers' KV block size (uniform across a cluster); 16 before any worker registers."""
        workers = self._view.workers()
        return workers[0].block_size if workers else 16

    def needed_blocks(self, projected_tokens: int, workers: list[WorkerView]) -> int:
        """Blocks the request needs on `workers` (the current view); raises the immediate refusals above."""
        if not workers:
            raise unavailable("no healthy worker is registered")
        need = math.ceil(projected_tokens / workers[0].block_size)
        largest = max(w.capacity_blocks for w in workers)
        if need > largest:
            raise Rejection(grpc.StatusCode.FAILED_PRECONDITION,
                            f"request projects {projected_tokens} tokens = {need} KV blocks; the largest worker "
                            f"holds {largest} blocks", "never_fits")
        # A request cannot span workers, so "the cluster can hold it" means some worker can.
        free = max(w.unreserved_blocks for w in workers)
        if free < need:
            raise self._exhausted(f"no worker has {need} unreserved KV blocks (most: {free}); retry later",
                                  "cluster_full")
        return need

    def released(self, worker: str, blocks: int, at: float) -> None:
        """The request placed on `worker` ended; `at` is the worker's time of freeing (0: unknown)."""
        self._view.note_released(worker, blocks, at)

    async def admit(self, projected_tokens: int, hashes: Sequence[bytes],
                    try_worker: Callable[[str], Awaitable[Reserved[T] | None]], deadline: float) -> Admitted[T]:
        """Reserve on the best worker that accepts; `try_worker` returns None on a refusal."""
        start = time.monotonic()
        queued = False
        try:
            while True:
                changed = self._view.changed
                workers = self._view.workers()
                if not workers and time.monotonic() < min(deadline, start + self._settings.max_wait_s):
                    # starting up, or the registry just lost its keys (Redis restarted): wait for heartbeats
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), 0.1)
                    continue
                try:
                    need = self.needed_blocks(projected_tokens, workers)
                except Rejection as exc:
                    if queued and exc.reason == "cluster_full":
                        exc.reason = "cluster_full_after_wait"
                        exc.message += f" (after waiting {time.monotonic() - start:.2f}s)"
                    raise
                for worker in rank_workers(workers, need, hashes, self._affinity, self._settings.affinity_weight):
                    hold = self._view.hold(worker.address, need)
                    try:
                        reserved = await try_worker(worker.address)
                    except BaseException:
                        self._view.drop(hold)
                        raise
                    if reserved is None:
                        self._view.drop(hold)
                    else:
                        self._view.confirm(hold, reserved.at)
                        self._affinity.record(hashes, worker.address)
                        return Admitted(worker.address, need, reserved.handle, time.monotonic() - start)
                if not queued:
                    if self.waiting >= self._settings.queue_size:
                        raise self._exhausted("admission queue is full; retry later", "queue_full")
                    self.waiting += 1
                    queued = True
                wait_until = min(deadline, start + self._settings.max_wait_s)
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    raise self._exhausted(f"no worker could reserve {need} KV blocks within "
                                          f"{self._settings.max_wait_s:.1f}s; retry later", "wait_timeout")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        finally:
            if queued:
                self.waiting -= 1
