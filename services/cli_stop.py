"""How `epd up` is stopped: the signals that stop it, handled so that its cleanup always runs.

Invariant: every handler installed here is the one that was there again once its block ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops `epd up`: Ctrl-C, `kill`, and its terminal closing (SIGHUP's default would end it at once, leaving
its services, each in a process group of its own, running on their ports)."""


@contextlib.contextmanager
def _handling(handler: Callable[[int, Any], Any] | int) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def wait_for_stop_signal(stopped: threading.Event | None = None) -> None:
    """Block until one of ``STOP_SIGNALS`` (handled: none kills us before cleanup), at once if ``stopped`` is set."""
    stopped = threading.Event() if stopped is None else stopped
    with _handling(lambda *_: stopped.set()):
        while not stopped.wait(0.5):
            pass


@contextlib.contextmanager
def interrupts() -> Iterator[threading.Event]:
    """``STOP_SIGNALS`` raise KeyboardInterrupt, so start-up is unwound and cleaned up either way, and set the
    event yielded. Installed whatever was there: a background job of a non-interactive shell inherits SIGINT
    ignored, which Python keeps, so Ctrl-C (`kill -INT`) was ignored during start-up and honoured after it. The
    event covers an interrupt raised where it is silenced: grpc's `Channel.__del__` wraps its work in a bare
    `except`, and a health check's channel is collected at every poll of start-up."""
    interrupted = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    with _handling(interrupt):
        yield interrupted


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """While stopping: a second Ctrl-C must not cut the cleanup short (stop() SIGKILLs after its grace period)."""
    with _handling(signal.SIG_IGN):
        yield
