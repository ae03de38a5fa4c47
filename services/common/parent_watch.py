"""A helper process that ends when the process that started it is gone, however that one ended.

A pool's worker processes (the encoder's decode pool) block on a queue whose write end each of them also holds,
so a parent killed with SIGKILL leaves them waiting forever, reparented to init: orphans that hold memory and
show in every process count. `exit_with_parent`, called first thing in such a child, starts a daemon thread that
reads the parent's pid every `interval_s` and ends the process (exit code 1) once it is not the pid the parent
passed down. A thread, not Linux's PR_SET_PDEATHSIG: that signal follows the thread that forked the child, and a
pool's children are forked from whichever thread submitted work.
"""

from __future__ import annotations

import os
import threading
import time

INTERVAL_S = 0.5
"""How often the parent's pid is read (an orphan lives at most about this long)."""


def exit_with_parent(parent: int | None, interval_s: float = INTERVAL_S) -> None:
    """End this process (``os._exit(1)``) within ``interval_s`` of its parent ``parent``'s exit; returns at once.

    ``parent`` is the pid of the process that started us, passed down rather than read here: one that died while
    this process was still starting would otherwise be taken to be init. None: the parent is read now (a child of
    a fork server, which the starting process does not know)."""
    if parent is None:
        parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="epd-parent-watch", daemon=True).start()
