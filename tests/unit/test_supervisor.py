"""`epd up`'s supervisor (services/launch/supervisor.py) on real processes: a service that exits is started
again with its role and settings after a back-off that doubles while it keeps exiting, each in one line, and
nothing is started once supervision stopped."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from services.launch import local
from services.launch.supervisor import Supervisor


def test_an_exiting_service_is_restarted_with_a_growing_back_off(tmp_path: Path) -> None:
    log = tmp_path / "worker-1.log"
    first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    # no EPD_MODEL: every restarted `epd serve worker` exits at once with a configuration error
    process = local.Process("worker", "127.0.0.1:1", 0, first, log, env={"EPD_MODEL": ""})
    lines: list[str] = []
    three = threading.Event()

    def report(line: str) -> None:
        lines.append(line)
        if sum("restarted:" in line for line in lines) == 3:
            three.set()

    supervisor = Supervisor([process], report=report, backoff_s=0.05, max_backoff_s=0.1, poll_s=0.02)
    with supervisor:
        assert three.wait(120), lines
    last = process.popen
    last.wait(60)
    exited = [line for line in lines if "exited:" in line]
    assert "with code 3" in exited[0] and "restarting in 0.05s" in exited[0], exited
    assert "restarting in 0.1s" in exited[1] and "restarting in 0.1s" in exited[2], exited  # doubled, capped
    assert [line.split("(restart ")[1] for line in lines if "restarted:" in line][:3] == ["1)", "2)", "3)"]
    assert supervisor.restarts(process) >= 3 and process.popen is last  # nothing after stop()
    assert "serve" in " ".join(last.args) and "worker" in last.args and log.exists()
