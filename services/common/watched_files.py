"""Files read once and again whenever they change (keys, limits, certificates rotated by cert-manager).

A change is noticed by `stat`: any file's (inode, size, mtime) differing from the last read. Invariant: the
contents held are always one complete, successful read and parse of every file; a file that cannot be read
or parsed later keeps the previous contents (logged), so a half-written rotation never locks everyone out
or lets everyone in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class WatchedFiles(Generic[T]):
    """`parse(contents of each path)`, re-done when a file changes; `what` names the files in messages."""

    def __init__(self, paths: Sequence[str], parse: Callable[[list[bytes]], T], what: str) -> None:
        self._paths = list(paths)
        self._parse = parse
        self._what = what
        self._signature: tuple[tuple[int, int, int], ...] | None = None
        self._value: T | None = None
        if not self.refresh():
            raise FileNotFoundError(f"{what} {', '.join(self._paths)} cannot be read")

    @property
    def value(self) -> T:
        """The contents as last parsed (without checking the files again)."""
        assert self._value is not None  # set by the constructor's successful refresh
        return self._value

    def current(self) -> T:
        """The contents, re-read first when a file changed."""
        self.refresh()
        return self.value

    def refresh(self) -> bool:
        """Re-read and parse when a file changed; True when new contents were taken."""
        try:
            stats = [os.stat(p) for p in self._paths]
            signature = tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)
            if signature == self._signature:
                return False
            value = self._parse([Path(p).read_bytes() for p in self._paths])
        except (OSError, ValueError) as exc:
            log.warning("%s %s not used (%s); keeping the previous contents", self._what, self._paths, exc)
            return False
        self._signature, self._value = signature, value
        return True
