"""Starting one service by role name (what `epd serve <role>` runs)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Awaitable, Callable

from services.common.config import ServiceConfig
from services.encoder.config import EncoderConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig

CONFIGS: dict[str, type[ServiceConfig]] = {
    "router": RouterConfig,
    "encoder": EncoderConfig,
    "worker": WorkerConfig,
}


async def start_role(role: str, config: ServiceConfig) -> Callable[[], Awaitable[None]]:
    """Start the service; return an async function that stops it."""
    # Compute threads (the engine, the vision tower) hold the GIL in long Python stretches; the event
    # loop that streams tokens and answers admission waits up to this interval for it (default 5 ms).
    sys.setswitchinterval(0.001)
    stop = await _start(role, config)
    # What start-up loaded (tokenizer, model code, protobuf descriptors) lives as long as the process:
    # keep it out of the collector, so a full collection takes milliseconds, not a 200 ms pause.
    gc.freeze()
    return stop


async def _start(role: str, config: ServiceConfig) -> Callable[[], Awaitable[None]]:
    if role == "router":
        from services.router.server import start_router

        return await start_router(config)
    if role == "encoder":
        from services.encoder.server import start_encoder

        running = await start_encoder(config)
        return running.stop
    from services.worker.server import start_worker

    worker = await start_worker(config)
    return worker.stop
