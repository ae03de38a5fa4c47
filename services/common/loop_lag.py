"""How late a service's event loop runs what is due: a task asks to wake every `PERIOD_S` and records the delay.

Why: a refusal, a token relayed, an admission answered all wait behind whatever the loop is running; when the
loop is the bottleneck (a router on two shared cores admitting an open loop of images), its lag is what a client
sees added to each of them, and no other metric shows it. Invariants: while the loop runs, one sample per period
(the wake-up's delay past its due time, never negative); a sample costs a bisect (`FastHistogram`) and the task
~20 us of CPU, 20 times a second; the task ends when cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

PERIOD_S = 0.05
"""How often the loop is asked to wake: often enough to catch a stall of a tenth of a second several times."""

NAME = "epd_event_loop_lag_seconds"
DESCRIPTION = "seconds the event loop woke later than asked (sampled every 50 ms)"


class Recorder(Protocol):
    def record(self, value: float) -> None: ...


class Samples(list):
    """A `Recorder` keeping every sample (seconds): a benchmark's own loop, or a test's."""

    def record(self, value: float) -> None:
        self.append(value)


async def watch(recorder: Recorder, period_s: float = PERIOD_S) -> None:
    """Record the running loop's lag into `recorder` every `period_s` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        recorder.record(max(0.0, loop.time() - due))
