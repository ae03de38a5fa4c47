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


async def run_until_signalled(start: Callable[[], Awaitable[Callable[[], Awaitable[None]]]]) -> None:
    """Await `start()` (which returns an async stop function, a drain for the services), then wait for
    SIGINT/SIGTERM and stop. A second signal while stopping ends the process at once (exit code 1)."""
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
    await stop_event.wait()
    await stop()
