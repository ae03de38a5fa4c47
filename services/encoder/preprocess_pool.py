"""Bounded process pool for the encoder's CPU image work (decode, orientation, colour).

`PreprocessPool` wraps a `ProcessPoolExecutor` (spawn context by default: children never inherit
CUDA or torch state from the parent) behind a counted admission bound, so overload turns into an
immediate `QueueFull` (the server's RESOURCE_EXHAUSTED) instead of a growing backlog.

Invariant: `outstanding` (slots reserved plus jobs accepted and not yet finished, running or
waiting) never exceeds `max_queue`. A slot is taken under the lock before the job is handed to
the executor and is released exactly once: by the future's done callback whatever the outcome
(result, exception, cancellation), at once when the hand-off itself fails, or by
`PoolReservation.release` when a reserved slot goes unused.

Children import only this module's dependencies (PIL, numpy, `services.common.media`) until their
first video: `services.encoder.video_decode` resizes frames with torch (one thread), imported then.
With the spawn and forkserver contexts Python also re-imports the parent's `__main__` module in
each child, so the encoder's entry point must not import torch at module level.

`nice` > 0 runs the children at that lower CPU priority (see services/encoder/priority.py).

If a child dies (a decoder crash, the OOM killer), the executor breaks: the futures then in flight
fail with `BrokenProcessPool`, and the next `submit` starts a fresh executor.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from services.common.image_decode import decode_image
from services.common.media import ImageHeader, MediaLimits
from services.common.parent_watch import exit_with_parent
from services.common.priority import lower_priority

T = TypeVar("T")


class QueueFull(RuntimeError):
    """The pool already holds `max_queue` outstanding jobs; retry later (RESOURCE_EXHAUSTED)."""

    def __init__(self, outstanding: int, max_queue: int) -> None:
        self.outstanding = outstanding
        self.max_queue = max_queue
        super().__init__(f"preprocessing queue is full ({outstanding}/{max_queue} jobs outstanding)")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.outstanding, self.max_queue))


@dataclass(frozen=True)
class PreprocessSettings:
    """What a child needs besides the bytes. `target_pixels` opts in to reduced-scale JPEG decode
    (see `services.common.image_decode.decode_image`); None keeps decoding exact."""

    limits: MediaLimits = field(default_factory=MediaLimits)
    target_pixels: int | None = None


@dataclass(frozen=True)
class PreprocessResult:
    """A decoded image as a (height, width, 3) uint8 RGB array, its header and timings.

    `queue_s` is the wait from `submit` to the child starting (monotonic clocks are shared by
    processes on one host); `decode_s` the child's decode time.
    """

    pixels: np.ndarray
    header: ImageHeader
    draft_factor: int
    queue_s: float
    decode_s: float

    def image(self) -> Image.Image:
        return Image.fromarray(self.pixels, "RGB")


def preprocess_job(
    data: bytes, settings: PreprocessSettings, submitted_at: float, index: int | None = None
) -> PreprocessResult:
    """Runs in a child: decode `data` to RGB. Raises `MediaError` for a refused image."""
    started = time.monotonic()
    decoded = decode_image(data, settings.limits, target_pixels=settings.target_pixels, index=index)
    pixels = np.asarray(decoded.image, dtype=np.uint8)
    return PreprocessResult(
        pixels=pixels,
        header=decoded.header,
        draft_factor=decoded.draft_factor,
        queue_s=max(0.0, started - submitted_at),
        decode_s=time.monotonic() - started,
    )


def _start_worker(parent: int | None, nice: int) -> None:
    """A pool process's first act: end with the process that started it (``parent``: the encoder's pid, None for a
    fork server's child), so a killed encoder leaves no orphans; then take its lower priority."""
    exit_with_parent(parent)
    lower_priority(nice)


class PreprocessPool:
    """A process pool with at most `max_queue` jobs outstanding (see module invariant)."""

    def __init__(
        self,
        workers: int,
        max_queue: int,
        *,
        mp_context: str = "spawn",
        max_tasks_per_child: int | None = None,
        nice: int = 0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if max_queue < workers:
            raise ValueError(f"max_queue ({max_queue}) must be >= workers ({workers})")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(
                f"mp_context must be 'spawn' or 'forkserver' (fork is unsafe with torch), got {mp_context!r}"
            )
        self.workers = workers
        self.max_queue = max_queue
        self._context = multiprocessing.get_context(mp_context)
        self._max_tasks_per_child = max_tasks_per_child
        self._nice = nice
        self._lock = threading.Lock()
        self._outstanding = 0
        self._closed = False
        self._broken = False
        self._executor = self._new_executor()

    @property
    def outstanding(self) -> int:
        """Jobs accepted and not finished (running or waiting)."""
        with self._lock:
            return self._outstanding

    def submit(
        self, data: bytes, settings: PreprocessSettings, *, index: int | None = None
    ) -> Future[PreprocessResult]:
        """Queue one image; raises `QueueFull` at once when `max_queue` jobs are outstanding.

        The future yields a `PreprocessResult`, or raises `MediaError` (bad image, INVALID_ARGUMENT)
        or `BrokenProcessPool` (a child died). Use `asyncio.wrap_future` from async code.
        """
        return self.submit_call(preprocess_job, data, settings, time.monotonic(), index)

    def submit_call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run any picklable top-level `fn(*args)` in a child under the same bound."""
        self._take(1)
        return self._submit_taken(fn, *args)

    def reserve(self, count: int) -> PoolReservation:
        """Take `count` slots at once (all or none; `QueueFull` when they do not fit).

        A multi-item request reserves every item it may need to decode before any work starts,
        so a refusal never leaves half a request queued.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._take(count)
        return PoolReservation(self, count)

    def _take(self, count: int) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("preprocess pool is closed")
            if self._outstanding + count > self.max_queue:
                raise QueueFull(self._outstanding, self.max_queue)
            self._outstanding += count

    def _submit_taken(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Hand a job whose slot is already counted to the executor (the slot is released once)."""
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("preprocess pool is closed")
                executor = self._current_executor_locked()
            try:
                future = executor.submit(fn, *args)
            except BrokenProcessPool:
                with self._lock:
                    self._broken = True
                    executor = self._current_executor_locked()
                future = executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(functools.partial(self._on_done, executor))
        return future

    def warm_up(self, timeout: float = 60.0) -> None:
        """Start every child now (each imports PIL and numpy once) instead of on first use."""
        futures = [self.submit_call(abs, 0) for _ in range(self.workers)]
        for future in futures:
            future.result(timeout=timeout)

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stop accepting work and wait for the children to exit (running jobs finish)."""
        with self._lock:
            self._closed = True
            executor = self._executor
        executor.shutdown(wait=True, cancel_futures=cancel_pending)

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel_pending=True)

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=self._context,
            max_tasks_per_child=self._max_tasks_per_child,
            initializer=_start_worker,
            initargs=(os.getpid() if self._context.get_start_method() == "spawn" else None, self._nice),
        )

    def _current_executor_locked(self) -> ProcessPoolExecutor:
        if self._broken:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            self._broken = False
        return self._executor

    def _on_done(self, executor: ProcessPoolExecutor, future: Future[Any]) -> None:
        broken = not future.cancelled() and isinstance(future.exception(), BrokenProcessPool)
        with self._lock:
            self._outstanding -= 1
            if broken and executor is self._executor:  # not one already replaced
                self._broken = True

    def _release(self, count: int = 1) -> None:
        with self._lock:
            self._outstanding -= count


class PoolReservation:
    """Slots taken from a `PreprocessPool` before the jobs exist.

    Each slot is spent by `submit` (then released by the job's completion) or handed back by
    `release`; `release` is idempotent, so calling it on every exit path never double-frees.
    Owned by one caller (not thread-safe).
    """

    def __init__(self, pool: PreprocessPool, count: int) -> None:
        self._pool = pool
        self._left = count

    @property
    def unused(self) -> int:
        return self._left

    def submit(
        self,
        data: bytes,
        settings: PreprocessSettings,
        *,
        index: int | None = None,
    ) -> Future[PreprocessResult]:
        """Decode one image on a reserved slot (same future contract as `PreprocessPool.submit`)."""
        if self._left < 1:
            raise RuntimeError("no reserved preprocessing slot left")
        self._left -= 1
        return self._pool._submit_taken(preprocess_job, data, settings, time.monotonic(), index)

    def submit_call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run any picklable top-level `fn(*args)` on a reserved slot (a video's decode job)."""
        if self._left < 1:
            raise RuntimeError("no reserved preprocessing slot left")
        self._left -= 1
        return self._pool._submit_taken(fn, *args)

    def release(self, count: int | None = None) -> None:
        """Give back `count` unused slots (all of them when None); never more than are left."""
        count = self._left if count is None else min(count, self._left)
        if count > 0:
            self._pool._release(count)
            self._left -= count
