"""Process plumbing shared by `epd serve <role>`: logging, signals, running until stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import torch

from services.common import logs


def setup_logging(level: str, service: str = "epd", fmt: str | None = None) -> None:
    """Logging for a service process: text or JSON lines (`fmt`, else `EPD_LOG_FORMAT`; services/common/logs.py)."""
    logs.setup_logging(level, service, fmt)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


LAUNCHER_POLL_S = 0.5
"""How often a service started by a launcher looks whether it is still there."""


async def run_until_signalled(
    start: Callable[[], Awaitable[Callable[[], Awaitable[None]]]], launcher_pid: int = 0
) -> None:
    """Await `start()` (which returns an async stop function, a drain for the services), then wait for
    SIGINT/SIGTERM, or for the process ``launcher_pid`` (when not 0) to be gone, and stop. A second signal while
    stopping ends the process at once (exit code 1). The launcher's own stop signals its services; the watch
    covers a launcher that could not (killed with SIGKILL), whose services would otherwise hold their ports."""
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if stop_event.is_set():
            logging.getLogger(__name__).warning("second signal while draining: exiting now")
            os._exit(1)
        stop_event.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled)
    stop = await start()
    watch = asyncio.create_task(_launcher_gone(launcher_pid, stop_event)) if launcher_pid else None
    await stop_event.wait()
    if watch is not None:
        watch.cancel()
    await stop()


async def _launcher_gone(pid: int, stop_event: asyncio.Event) -> None:
    while process_alive(pid):
        await asyncio.sleep(LAUNCHER_POLL_S)
    logging.getLogger(__name__).warning("the process that started this service (pid %d) is gone: stopping", pid)
    stop_event.set()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and has not exited (a zombie its parent has not reaped yet counts
    as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
