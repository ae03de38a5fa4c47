"""How many intra-op CPU threads one step runs with: a large step borrows cores the rest of the box leaves idle.

On the CPU a worker's services each get their share of the cores (`epd up` on 2 cores: one thread each), and
while the engine computes, the others often wait for it. A step of many tokens (prefill) splits well over
threads, its products and attention being large; a decode step of a few rows does not (its small products pay
for waking the threads), so only steps of at least ``LARGE_STEP_TOKENS`` tokens take more threads, and only as
many as there are idle cores as the step begins: a thread on a core something else is using (an encoder's vision
tower, the client) stalls every parallel region of the step, which then ends later than on one thread. The
box's count of running tasks includes this process's own OpenMP workers while they spin after a parallel region
(libgomp spins for milliseconds before it sleeps): those are not counted as busy, or every large step after a large
step would find the core its own worker holds taken and run on one thread. The process's own count is restored
after. Invariant: outside ``for_step`` the process runs its own thread count; nothing changes on a GPU, where the
step's work is on the device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator

import torch

LARGE_STEP_TOKENS = 256
"""Tokens from which a step takes the larger thread count. On a 2-core AMD EPYC (Zen 5) the prefill steps of 16
prompts of 295 tokens (the 256-wide, 8-layer test folder, bfloat16) took 186 ms on two threads against 333 on one,
while 16-row decode steps gained nothing (docs/engine.md)."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_threads(requested: int, device: torch.device, tensor_parallel_size: int) -> int:
    """The threads a large step runs with: ``requested`` when set (> 0); automatic (0): on the CPU twice this
    process's own thread count, at most the cores it may use; the process's own count on another device or when
    tensor-parallel ranks share the cores."""
    own = torch.get_num_threads()
    if requested > 0:
        return requested
    if device.type != "cpu" or tensor_parallel_size > 1:
        return own
    return max(own, min(usable_cores(), 2 * own))


LOADAVG = "/proc/loadavg"


@functools.cache
def _loadavg() -> int | None:
    """One descriptor of ``LOADAVG`` for the whole process (None where there is none); read with ``pread``."""
    try:
        return os.open(LOADAVG, os.O_RDONLY)
    except OSError:
        return None


def runnable_tasks() -> int | None:
    """How many tasks on the box are running or ready to run now (the kernel's count in ``/proc/loadavg``, the
    calling thread included); None where the OS gives no such count. One read is ~1 us."""
    fd = _loadavg()
    if fd is None:
        return None
    fields = os.pread(fd, 128, 0).split()  # b"0.52 0.61 0.70 2/431 12345"
    return int(fields[3].split(b"/")[0])


def own_native_running() -> int:
    """How many threads of this process that Python did not start are running now (``/proc/self/task``; 0 where
    there is none): its compute library's workers, spinning after their last parallel region or at work."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    python = {thread.native_id for thread in threading.enumerate()}
    running = 0
    for task in tasks:
        if int(task) in python:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as stat:
                running += stat.read().rsplit(b")", 1)[1].split(None, 1)[0] == b"R"
        except OSError:  # the thread ended meanwhile
            continue
    return running


class StepThreads:
    """Switches torch's intra-op threads around a large step; a no-op where ``threads`` is the process's own.

    ``runnable`` tells how busy the box is (``runnable_tasks``), ``own_workers`` how many of those tasks are this
    process's compute workers (``own_native_running``); a large step adds to the process's own threads at most the
    ``cores`` (those it may use) nobody else is running on, and all ``threads`` where ``runnable`` answers None."""

    def __init__(
        self,
        threads: int,
        runnable: Callable[[], int | None] | None = None,
        cores: int | None = None,
        own_workers: Callable[[], int] | None = None,
    ) -> None:
        self.threads = threads
        self._runnable = runnable or runnable_tasks
        self._own_workers = own_workers or own_native_running
        self._cores = cores or usable_cores()

    def threads_for(self, num_tokens: int) -> int:
        """The intra-op threads a step of ``num_tokens`` tokens runs with."""
        own = torch.get_num_threads()
        if num_tokens < LARGE_STEP_TOKENS:
            return own
        if self.threads <= own:  # asked for no more than the process runs: nothing to borrow
            return self.threads
        busy = self._runnable()
        if busy is None:
            return self.threads
        if busy > 1:  # this process's workers hold a core only until the step gives them work
            busy -= self._own_workers()
        idle = self._cores - max(busy, 1)  # this thread is running, so it counts itself
        return own + max(0, min(self.threads - own, idle))

    @contextlib.contextmanager
    def for_step(self, num_tokens: int) -> Iterator[None]:
        """Run the body with ``threads_for(num_tokens)`` threads."""
        own = torch.get_num_threads()
        threads = self.threads_for(num_tokens)
        if threads == own:
            yield
            return
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(own)
