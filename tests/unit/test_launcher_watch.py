"""A service started by a launcher drains and stops once the launcher is gone, however it ended (SIGKILL
included, a zombie not yet reaped included); without a launcher pid nothing is watched."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from services.common import service_main
from services.common.service_main import process_alive, run_until_signalled


def test_a_process_is_alive_until_it_exits_and_a_zombie_counts_as_gone() -> None:
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_alive(child.pid)
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(child.pid):  # not reaped yet: a zombie
            assert time.monotonic() < deadline, "a killed child still reads as alive"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)


def test_the_service_stops_when_its_launcher_is_killed(monkeypatch) -> None:
    monkeypatch.setattr(service_main, "LAUNCHER_POLL_S", 0.05)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped: list[float] = []

    async def start():
        async def stop() -> None:
            stopped.append(time.monotonic())

        loop = asyncio.get_running_loop()
        loop.call_later(0.3, launcher.send_signal, signal.SIGKILL)  # SIGKILL: the launcher cannot stop us itself
        return stop

    began = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(run_until_signalled(start, launcher.pid), timeout=20))
    finally:
        launcher.kill()
        launcher.wait()
    assert len(stopped) == 1 and stopped[0] - began >= 0.3


def test_without_a_launcher_only_a_signal_stops_the_service() -> None:
    stopped: list[bool] = []

    async def start():
        async def stop() -> None:
            stopped.append(True)

        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)
        return stop

    asyncio.run(asyncio.wait_for(run_until_signalled(start), timeout=20))
    assert stopped == [True]
