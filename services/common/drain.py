"""Graceful drain on SIGTERM: a service's in-flight work counted, new work refused once draining.

Every service counts the calls it is serving (`enter`/`leave`, paired). On SIGTERM it calls `start()`:
from then on `enter` refuses (the caller answers UNAVAILABLE, so the router tries another place), and
`wait_idle(timeout_s)` returns once nothing is in flight or the timeout passed. What each service does
around it (leave the registry, end what is left so the router migrates it) is the service's own drain
sequence (docs/reliability.md). Invariant: `in_flight` equals the entered calls not yet left; it never
goes below zero, and `wait_idle` is true exactly when it reached zero.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        """Refuse new work from now on (idempotent)."""
        self.draining = True

    def enter(self) -> bool:
        """Count one call in; False (nothing counted) once draining: refuse it."""
        if self.draining:
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        """The call counted by a successful `enter` ended."""
        if self.in_flight <= 0:
            raise RuntimeError("Drain.leave without a matching enter")
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight, at most `timeout_s`; True when idle."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        return self.in_flight == 0


async def drained(drain: Drain, timeout_s: float, on_timeout: Callable[[], None], settle_s: float = 5.0) -> bool:
    """Wait for `drain` to go idle within `timeout_s`; if it does not, call `on_timeout()` (which ends the
    calls still running) and wait up to `settle_s` more for them to leave. True when everything finished
    within the timeout, False when some had to be ended."""
    if await drain.wait_idle(timeout_s):
        return True
    on_timeout()
    await drain.wait_idle(settle_s)
    return False
