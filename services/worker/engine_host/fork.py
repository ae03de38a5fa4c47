"""Starting the engine process by fork: when a worker may, and what a forked child leaves of its parent.

A spawned engine process imports torch, transformers and the engine afresh (~3.5 CPU-seconds on a 2-core box,
most of a CPU worker's start); a forked one has them already. Forking is safe only before the parent started
anything a child cannot inherit: another thread (its locks may be held mid-fork), torch's OpenMP pool (a child
forked after the parent's first parallel op hangs at its own first one) or CUDA. `may_fork` is true only then:
the main thread alone, no native thread started since this module was imported or the process forked (the
pool's would be), CUDA not initialised. A worker asks it first thing, before its telemetry, Redis client or gRPC
server start, and its process has run no torch op (its engine is the child's).

`detach_from_parent`, first thing in the child, drops what the fork copied of the parent's signal handling and
event loop: the parent's asyncio loop as the running loop, and its wake-up socket, through which a Ctrl-C
reaching the whole process group would otherwise tell the parent twice (its second signal exits at once).
Signals stay blocked around the fork (`signals_blocked`) until the child reset its handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Iterator

import torch

_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_NAME = 15


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


_threads_at_start = _native_threads()  # after importing torch; in a forked process, at the fork (one thread)


def _forked() -> None:
    global _threads_at_start
    _threads_at_start = _native_threads()


os.register_at_fork(after_in_child=_forked)


def may_fork() -> bool:
    """Whether a child forked now inherits nothing unsafe (see the module docstring)."""
    return threading.active_count() == 1 and _native_threads() == _threads_at_start and not torch.cuda.is_initialized()


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back in this thread while the block runs (a fork inside it hands the child the
    mask: `detach_from_parent` lifts it there); the parent gets what arrived meanwhile afterwards."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def detach_from_parent() -> None:
    """In a forked child: no running loop, no wake-up socket, SIGTERM ends it, SIGINT ignored (the worker drains
    on Ctrl-C, then stops its engine), then the signals unblocked; named `epd-engine` (what `top` and `ps -o comm`
    show: a forked child's command line is the worker's). Harmless in a spawned child."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, b"epd-engine", 0, 0, 0)
    asyncio.events._set_running_loop(None)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
