"""Samples every worker's published KV state from the registry while load runs (admission test and bench)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from services.common.registry import Registry


@dataclass
class KVSampler:
    """``with KVSampler(registry) as sampler: ...``: ``states`` holds each worker's state every ``interval_s``."""

    registry: Registry
    interval_s: float = 0.02
    states: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> KVSampler:
        self._thread = threading.Thread(target=self._run, name="kv-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for member in self.registry.members("worker") or []:
                self.states.append(member.state)
            time.sleep(self.interval_s)

    def peaks(self) -> dict[str, int]:
        """Over all samples: the most blocks reserved and in use on any worker, its capacity, preemptions."""
        if not self.states:
            return {"samples": 0}
        return {
            "samples": len(self.states),
            "max_reserved_blocks": max(s["reserved_blocks"] for s in self.states),
            "max_used_blocks": max(s["total_blocks"] - s["free_blocks"] for s in self.states),
            "capacity_blocks": min(s["capacity_blocks"] for s in self.states),
            "preemptions": max(s["preemptions"] for s in self.states),
        }
