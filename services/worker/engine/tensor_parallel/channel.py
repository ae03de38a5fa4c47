"""Rank 0's word to the other ranks each step (nano-vllm's way): one pickled message in a shared-memory file
and an event per rank; what each rank then computes meets again in the step's collectives."""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

CHANNEL_BYTES = 16 << 20
"""The message area: a step's ints (ids, slots, positions, attention metadata) as a pickled list."""
_HEADER = struct.Struct("<Q")
PREFIX = "epd-tp-"
"""Channel files are ``epd-tp-<pid of rank 0>-<random>``."""


class StepChannel:
    """A shared-memory area rank 0 writes and every other rank reads, and one event per reader.

    Invariant: rank 0 writes the next message only after the ranks have read the last (each step ends in
    collectives every rank joins after reading; ``close``'s last message needs no answer). The file is removed
    from /dev/shm as soon as every rank has opened it (``unlink``), so nothing is left behind however the
    processes end.
    """

    def __init__(self, path: str, events: list[Any], reader: int | None) -> None:
        self.path = path
        self.events = events  # one per reader (ranks 1..n-1)
        self.reader = reader  # None on rank 0, else this rank's index into events
        fd = os.open(path, os.O_RDWR)
        try:
            self.area = mmap.mmap(fd, CHANNEL_BYTES)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, events: list[Any]) -> StepChannel:
        """Rank 0's side: a new area in /dev/shm (the temporary directory where there is none), named after this
        process; first the areas of processes that died before their ranks opened them are removed."""
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_orphans(directory)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(fd, CHANNEL_BYTES)
        finally:
            os.close(fd)
        return cls(path, events, None)

    def unlink(self) -> None:
        """Remove the file (the mapping stays); once every rank has opened it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def send(self, message: Any) -> None:
        """Rank 0: write ``message`` and wake every rank."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if _HEADER.size + len(data) > CHANNEL_BYTES:
            raise ValueError(f"a tensor-parallel step message of {len(data)} bytes exceeds {CHANNEL_BYTES}")
        self.area[: _HEADER.size] = _HEADER.pack(len(data))
        self.area[_HEADER.size : _HEADER.size + len(data)] = data
        for event in self.events:
            event.set()

    def receive(self, alive: Callable[[], bool], poll_s: float = 0.5) -> Any:
        """Another rank: wait for the next message (checking ``alive`` every ``poll_s``; False ends the wait
        with None) and return it."""
        event = self.events[self.reader]
        while not event.wait(poll_s):
            if not alive():
                return None
        (size,) = _HEADER.unpack(self.area[: _HEADER.size])
        message = pickle.loads(self.area[_HEADER.size : _HEADER.size + size])
        event.clear()
        return message


def remove_orphans(directory: str) -> None:
    """Remove the channel files in ``directory`` whose creator (the pid in the name) no longer runs: a worker
    killed while its ranks were still starting leaves its file behind."""
    for name in os.listdir(directory):
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def parent_alive(parent: int) -> Callable[[], bool]:
    """True while the process that started this one (``parent``, its pid) is still its parent."""
    return lambda: os.getppid() == parent


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
