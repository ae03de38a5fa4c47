"""The garbage collector's full collections taken off the request path: a serving process runs them when it is quiet.

Python runs a full collection (the oldest generation: every tracked object that survived two young collections)
whenever a quarter more objects reached it since the last one. In a serving process those objects are the requests
in flight, so the collections come exactly when many are: with ~250 image requests in flight the router's walked
~85,000 objects and held its event loop 74-112 ms (a 2-core AMD EPYC, an open loop of fresh images), every request
waiting behind it, refusals included. `FullCollections.start` freezes what start-up loaded (it never dies), turns the
automatic full collections off (young ones stay automatic: they are short and collect most cycles) and runs one from
a thread of its own when the process has been quiet (under `QUIET_SHARE` of a core over the last `CHECK_S`) and at
least `MIN_INTERVAL_S` passed since the last, or in any case once `MAX_INTERVAL_S` passed, which bounds what cyclic
garbage a process under constant load can hold.

Invariants: after `start`, no automatic collection reaches the oldest generation; between two full collections
there are at most `MAX_INTERVAL_S` (plus one check); `stop` ends the thread and restores the thresholds it found.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

CHECK_S = 1.0
"""How often the thread looks at the process's CPU time."""
QUIET_SHARE = 0.1
"""Below this share of one core over the last check, the process counts as quiet."""
MIN_INTERVAL_S = 10.0
"""A quiet process collects at most this often."""
MAX_INTERVAL_S = 120.0
"""A busy process collects at least this often."""
_NEVER = 1 << 30
"""A full-collection threshold no process reaches (young collections between two full ones)."""


class FullCollections:
    """Full collections at quiet moments (see the module docstring); one per process."""

    def __init__(
        self,
        check_s: float = CHECK_S,
        quiet_share: float = QUIET_SHARE,
        min_interval_s: float = MIN_INTERVAL_S,
        max_interval_s: float = MAX_INTERVAL_S,
    ) -> None:
        if not 0 < min_interval_s <= max_interval_s:
            raise ValueError(f"need 0 < min_interval_s <= max_interval_s, got {min_interval_s}, {max_interval_s}")
        self.check_s = check_s
        self.quiet_share = quiet_share
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.collections = 0  # full collections this object ran
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._thresholds = gc.get_threshold()

    def start(self) -> None:
        """Freeze what exists now, stop automatic full collections and start the collecting thread."""
        gc.freeze()
        self._thresholds = gc.get_threshold()
        young, middle, _ = self._thresholds
        gc.set_threshold(young, middle, _NEVER)
        self._thread = threading.Thread(target=self._run, name="full-collections", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and give Python back its own thresholds."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        gc.set_threshold(*self._thresholds)

    def due(self, since_last_s: float, busy_share: float) -> bool:
        """Whether to collect now, ``since_last_s`` after the last full collection, the process having used
        ``busy_share`` of a core over the last check."""
        if since_last_s >= self.max_interval_s:
            return True
        return since_last_s >= self.min_interval_s and busy_share < self.quiet_share

    def _run(self) -> None:
        last = time.monotonic()
        cpu, wall = time.process_time(), last
        while not self._stopped.wait(self.check_s):
            now, now_cpu = time.monotonic(), time.process_time()
            busy = (now_cpu - cpu) / max(now - wall, 1e-6)
            if self.due(now - last, busy):
                started = time.perf_counter()
                gc.collect()
                self.collections += 1
                log.debug(
                    "full collection: %.1f ms at %.0f %% of a core", 1e3 * (time.perf_counter() - started), 1e2 * busy
                )
                now = last = time.monotonic()
                now_cpu = time.process_time()
            cpu, wall = now_cpu, now
