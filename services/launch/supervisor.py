"""`epd up`'s supervision: a service that exits is started again, after a back-off, and reported in one line.

A thread polls the processes; one that exited (crash, kill, or SIGTERM from outside, which drains it
first) is started again with the same role, ports and settings (`local.respawn`) once its back-off has
passed. The back-off doubles from `backoff_s` up to `max_backoff_s` with each exit that follows a start
by less than `stable_s`, and starts over after a service stayed up that long.
Invariant: while supervising, each process is alive or waits out its back-off; after `stop()` returns
nothing is started again (stop supervision before stopping the cluster: `with Supervisor(...)`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.launch import local


@dataclass
class _Watch:
    process: local.Process
    started: float = field(default_factory=time.monotonic)
    backoff_s: float = 0.0
    restart_at: float | None = None  # set while it waits out its back-off
    restarts: int = 0


class Supervisor:
    def __init__(
        self,
        processes: Sequence[local.Process],
        report: Callable[[str], None] = print,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
        poll_s: float = 0.2,
    ) -> None:
        self._watches = [_Watch(p) for p in processes]
        self._report = report
        self._backoff_s, self._max_backoff_s, self._stable_s, self._poll_s = backoff_s, max_backoff_s, stable_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epd-supervisor", daemon=True)

    def restarts(self, process: local.Process) -> int:
        """How many times `process` has been started again."""
        return next(w.restarts for w in self._watches if w.process is process)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop supervising (returns once the thread ended: nothing is started again after this)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            for watch in self._watches:
                self._check(watch, time.monotonic())

    def _check(self, watch: _Watch, now: float) -> None:
        process = watch.process
        if watch.restart_at is None:
            code = process.popen.poll()
            if code is None:
                return
            up_s = now - watch.started
            quick = up_s < self._stable_s and watch.backoff_s > 0
            watch.backoff_s = min(self._max_backoff_s, 2 * watch.backoff_s) if quick else self._backoff_s
            watch.restart_at = now + watch.backoff_s
            self._report(
                f"  exited:  {process.role:8s} {process.address} with code {code} after {up_s:.0f}s; "
                f"restarting in {watch.backoff_s:g}s (log {process.log_path})"
            )
        elif now >= watch.restart_at:
            local.respawn(process)
            watch.restart_at, watch.started = None, now
            watch.restarts += 1
            self._report(f"  restarted: {process.role:8s} {process.address} (restart {watch.restarts})")
