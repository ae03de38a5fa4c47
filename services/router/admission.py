"""Admission: a request is placed only where its projected tokens' KV blocks are reserved.

A request's need on a worker is counted in that worker's own KV blocks, `ceil(projected tokens / its
block size)` for one choice, the shared-prompt formula for n (workers may differ in block size;
services/router/request_blocks.py, services/common/kv_blocks.py), and every hold,
release and `Admitted.blocks` uses the chosen worker's need. Policy, in order: no live worker ->
UNAVAILABLE (after waiting up to the queue deadline for one to register); no worker whose capacity
holds its own need -> FAILED_PRECONDITION; no worker with its own need unreserved in the router's
view -> RESOURCE_EXHAUSTED at once (a request cannot span workers, so the cluster's total is not
the test). Otherwise the ranked workers are asked in turn (the worker decides atomically); when
all refuse (the view was stale: another router got there first), the request waits in a bounded
queue until the view changes or its wait deadline, then gets RESOURCE_EXHAUSTED with
`retry-after-ms`. Invariant: `waiting` never exceeds `queue_size`, so overload turns into fast
refusals, not growing latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from services.router.cluster_view import ClusterView, WorkerView
from services.router.errors import RequestError, unavailable
from services.router.placement import PrefixAffinity, rank_workers
from services.router.request_blocks import RequestBlocks

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
    """A placed request; `blocks` is its need in `worker`'s block size, what `released` must be given."""

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

    def check_fits(self, request: RequestBlocks, workers: list[WorkerView]) -> None:
        """Raise the immediate refusals above for `workers` (the current view), each judged at its own size."""
        if not workers:
            raise unavailable("no healthy worker is registered")
        if not any(request.need_on(w) <= w.capacity_blocks for w in workers):
            needs = _needs(request, workers, "", lambda w: w.capacity_blocks, "the largest worker of that size holds")
            raise Rejection(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request projects {request.projected_tokens} tokens = {needs}",
                "never_fits",
            )
        # A request cannot span workers, so "the cluster can hold it" means some worker can.
        if not any(request.need_on(w) <= w.unreserved_blocks for w in workers):
            needs = _needs(request, workers, "unreserved ", lambda w: w.unreserved_blocks, "most:")
            raise self._exhausted(f"no worker has {needs}; retry later", "cluster_full")

    def released(self, worker: str, blocks: int, at: float) -> None:
        """The request placed on `worker` ended; `at` is the worker's time of freeing (0: unknown)."""
        self._view.note_released(worker, blocks, at)

    async def _place(
        self,
        request: RequestBlocks,
        workers: list[WorkerView],
        try_worker: Callable[[str], Awaitable[Reserved[T] | None]],
    ) -> tuple[str, int, T] | None:
        """Ask the ranked workers in turn, holding each one's own need meanwhile. Returns the first to
        accept as (address, its need, handle), with the prefix recorded at its block size; None when all refuse."""
        for worker in rank_workers(workers, request, self._affinity, self._settings.affinity_weight):
            need = request.need_on(worker)
            hold = self._view.hold(worker.address, need)
            try:
                reserved = await try_worker(worker.address)
            except BaseException:
                self._view.drop(hold)
                raise
            if reserved is None:
                self._view.drop(hold)
                continue
            self._view.confirm(hold, reserved.at)
            self._affinity.record(request.hashes(worker.block_size), worker.address)
            return worker.address, need, reserved.handle
        return None

    async def admit(
        self, request: RequestBlocks, try_worker: Callable[[str], Awaitable[Reserved[T] | None]], deadline: float
    ) -> Admitted[T]:
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
                    self.check_fits(request, workers)
                except Rejection as exc:
                    if queued and exc.reason == "cluster_full":
                        exc.reason = "cluster_full_after_wait"
                        exc.message += f" (after waiting {time.monotonic() - start:.2f}s)"
                    raise
                placed = await self._place(request, workers, try_worker)
                if placed is not None:
                    return Admitted(*placed, queue_s=time.monotonic() - start)
                if not queued:
                    if self.waiting >= self._settings.queue_size:
                        raise self._exhausted("admission queue is full; retry later", "queue_full")
                    self.waiting += 1
                    queued = True
                remaining = min(deadline, start + self._settings.max_wait_s) - time.monotonic()
                if remaining <= 0:
                    raise self._exhausted(
                        f"no worker could reserve {_needs(request, workers)} within "
                        f"{self._settings.max_wait_s:.1f}s; retry later",
                        "wait_timeout",
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        finally:
            if queued:
                self.waiting -= 1


def _needs(
    request: RequestBlocks,
    workers: list[WorkerView],
    adjective: str = "",
    most: Callable[[WorkerView], int] | None = None,
    label: str = "",
) -> str:
    """The request's need per block size among `workers` for messages, e.g. "25 KV blocks of 16 tokens
    (label M)" with M the largest `most` among the workers of that size; sizes joined by " or "."""
    parts = []
    for size in sorted({w.block_size for w in workers}):
        need = max(request.need_on(w) for w in workers if w.block_size == size)
        part = f"{need} {adjective}KV blocks of {size} tokens"
        if most is not None:
            part += f" ({label} {max(most(w) for w in workers if w.block_size == size)})"
        parts.append(part)
    return " or ".join(parts)
