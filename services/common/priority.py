"""CPU priority for compute threads (encoder tower and decode, worker engine), so serving never waits behind them;
and a process's CPU set (`EPD_CPUS`, like `taskset -c`), for one box shared by several services.

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


def parse_cpus(spec: str) -> set[int]:
    """CPU numbers from a `taskset -c` style list ("1", "0-3", "0,2-3"); ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{part!r} is an empty range")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{spec!r} names no CPU")
    return cpus


def pin_process(spec: str) -> None:
    """Run every thread of this process, and those it creates later, on the CPUs `spec` names ("" = leave as is).

    Linux sets affinity per thread and new threads inherit their creator's: every existing thread is
    pinned, not only the calling one. CPUs outside this machine's set are an error (OSError).
    """
    if not spec or not hasattr(os, "sched_setaffinity"):
        return
    cpus = parse_cpus(spec)
    tasks = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tasks:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
