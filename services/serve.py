"""Starting one service by role name (what `epd serve <role>` runs); its stop function drains first.

Stopping (SIGTERM, Ctrl-C) runs the role's drain sequence before closing anything: an encoder or a worker
leaves the registry, refuses new work and lets in-flight work finish for up to EPD_DRAIN_TIMEOUT_S (a
worker then ends what is left, and the routers migrate it); a router stops accepting and finishes its
streams within the same timeout (services/router/startup.py). docs/reliability.md has the whole sequence.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.common.collector import FullCollections
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
    # What start-up loaded (tokenizer, model code, protobuf descriptors) lives as long as the process: frozen out
    # of the collector (a full collection over it paused the router ~200 ms), and full collections run when quiet.
    collections = FullCollections()
    collections.start()

    async def stop_then_collector() -> None:
        await stop()
        collections.stop()

    return stop_then_collector


async def _start(role: str, config: ServiceConfig) -> Callable[[], Awaitable[None]]:
    if role == "router":
        from services.router.startup import start_router

        return await start_router(config)
    if role == "encoder":
        from services.encoder.server import start_encoder

        running = await start_encoder(config)
        return _drain_then_stop(running, config.drain_timeout_s)
    from services.worker.startup import start_worker

    worker = await start_worker(config)
    return _drain_then_stop(worker, config.drain_timeout_s)


class _Drainable(Protocol):
    async def drain(self, timeout_s: float) -> None: ...

    async def stop(self) -> None: ...


def _drain_then_stop(running: _Drainable, timeout_s: float) -> Callable[[], Awaitable[None]]:
    async def stop() -> None:
        await running.drain(timeout_s)
        await running.stop()

    return stop
