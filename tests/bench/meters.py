"""What a workload costs the processes `epd bench serve` watches: the router's and the client's CPU seconds, and the
router's event-loop lag buckets.

Invariants: a process's CPU is its threads' user + system time, never its children's; the lag buckets are the
router's `epd_event_loop_lag_seconds` (services/common/loop_lag.py) as its metrics endpoint exports them now, empty
where that endpoint is not known or not answering.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

from services.common import loop_lag
from tests.bench import leak_check


class CpuMeter:
    """A process's user + system CPU seconds (its threads, not its children)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            import psutil

            self._process: Any = psutil.Process(pid)
        except ImportError:
            self._process = None

    def seconds(self) -> float:
        if self._process is not None:
            times = self._process.cpu_times()
            return times.user + times.system
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def client_cpu_s() -> float:
    """This process's CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def router_lag_buckets(metrics_port: int) -> dict[float, float]:
    """The router's loop-lag histogram now, cumulative counts by bound (empty: port 0 or no answer)."""
    if not metrics_port:
        return {}
    try:
        return leak_check.metric_buckets(metrics_port, loop_lag.NAME)
    except OSError:
        return {}
