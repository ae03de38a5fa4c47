"""`HostDevice`'s staging ring: the host waits for (and counts) only a staging copy that has not completed.

CUDA events cannot exist here, so each ring slot gets an event stand-in that reports whether its copy is done
(``query``) and records waits (``synchronize``); the ring logic is the one the GPU runs.
"""

from __future__ import annotations

import torch

from services.worker.engine.host_device import RING, HostDevice, _Stage


class CopyEvent:
    """`torch.cuda.Event`'s two calls the ring makes, for a copy that is done or still in flight."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def ring_of(io: HostDevice, done: list[bool]) -> list[CopyEvent]:
    events = [CopyEvent(d) for d in done]
    io._rings[torch.int64] = [_Stage(torch.empty(64, dtype=torch.int64), e) for e in events]
    return events


def test_no_wait_is_counted_when_every_copy_had_completed() -> None:
    io = HostDevice(torch.device("cpu"))
    events = ring_of(io, [True] * RING)
    for _ in range(RING):
        io._stage(torch.int64, 16)
    assert io.waits == 0 and all(e.waited == 0 for e in events)


def test_a_copy_still_in_flight_is_waited_for_and_counted() -> None:
    io = HostDevice(torch.device("cpu"))
    events = ring_of(io, [True, False, True, False])
    for _ in range(RING):
        io._stage(torch.int64, 16)
    assert io.waits == 2 and [e.waited for e in events] == [0, 1, 0, 1]
