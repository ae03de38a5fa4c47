"""CPU priority for compute threads (encoder tower and decode, worker engine), so serving never waits behind them.

Decoding (pool processes), input preparation and the vision tower on CPU can use every core; the
event loop and gRPC's poller threads then wait for time slices and a refusal that costs
microseconds takes tens of milliseconds to leave. Running the compute at a higher nice value
(lower priority) keeps admission, refusals and pushes fast under any load. On Linux a thread's
nice value is its own and is inherited by the threads it creates (torch's OpenMP team included).
"""

from __future__ import annotations

import contextlib
import os
import threading


def lower_priority(increment: int) -> None:
    """Raise the calling thread's nice value by `increment` (no-op for 0 or where unsupported)."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
