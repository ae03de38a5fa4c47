"""Process plumbing shared by `epd serve <role>`: logging, signals, running until stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import torch


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


async def run_until_signalled(start: Callable[[], Awaitable[Callable[[], Awaitable[None]]]]) -> None:
    """Await `start()` (which returns an async stop function), then wait for SIGINT/SIGTERM."""
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_event.set)
    stop = await start()
    await stop_event.wait()
    await stop()
