"""How many intra-op CPU threads one step runs with: a large step borrows cores the rest of the box leaves idle.

On the CPU a worker's services each get their share of the cores (`epd up` on 2 cores: one thread each), and
while the engine computes, the others mostly wait for it. A step of many tokens (prefill) splits well over
threads, its products and attention being large; a decode step of a few rows does not (its small products pay
for waking the threads), so only steps of at least ``LARGE_STEP_TOKENS`` tokens take ``threads`` threads and the
process's own count is restored after. Invariant: outside ``for_step`` the process runs its own thread count;
nothing changes on a GPU, where the step's work is on the device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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


class StepThreads:
    """Switches torch's intra-op threads around a large step; a no-op where ``threads`` is the process's own."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    @contextlib.contextmanager
    def for_step(self, num_tokens: int) -> Iterator[None]:
        """Run the body with ``threads`` threads when the step has at least ``LARGE_STEP_TOKENS`` tokens."""
        own = torch.get_num_threads()
        if num_tokens < LARGE_STEP_TOKENS or self.threads == own:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(own)
