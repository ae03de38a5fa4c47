"""Handing values from a compute thread to an asyncio event loop with one wake-up per batch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class LoopMailbox:
    """``post(fn, value)`` from any thread runs ``fn(value)`` on the loop, in posting order.

    Invariant: at most one wake-up of the loop is pending. Waking a loop writes to its self-pipe, and
    the posting thread then waits for the GIL the woken loop has taken (up to the switch interval): a
    worker's engine thread posting each sequence's token separately lost a fifth of its time so. Values
    posted while a wake-up is pending ride on it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []
        self._pending = False

    def post(self, fn: Callable[[Any], None], value: Any) -> None:
        with self._lock:
            self._items.append((fn, value))
            if self._pending:
                return
            self._pending = True
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._pending = False
        for fn, value in items:
            fn(value)
