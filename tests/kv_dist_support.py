"""A decode worker's `PushKV` / `DistConnect` for KV transport tests: the real `WorkerServicer` handlers over a
stand-in engine host that keeps every chunk it is handed (no model), served on 127.0.0.1.

Run as a script (`python -m tests.kv_dist_support [stall]`) it serves one in its own process and prints its port;
with `stall`, a torch.distributed chunk's control message is taken and its bytes are never received (the process
prints `stalled` and waits to be killed): a peer that dies mid-transfer.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from services.common import grpc_server
from services.common.dist_receiver import DistReceiver, ReceiverAddress
from services.common.rpc.epd.v1 import worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.engine.kv_connector import KVChunk
from services.worker.server import WorkerServicer

LOCAL = ReceiverAddress("127.0.0.1", "127.0.0.1")


class ChunkHost:
    """The engine host's part a decode worker's `PushKV` uses: every chunk handed over is kept, in order."""

    def __init__(self) -> None:
        self.chunks: list[KVChunk] = []
        self.deliver: Any = None

    def receive_kv(self, chunk: KVChunk) -> Future[None]:
        self.chunks.append(chunk)
        done: Future[None] = Future()
        done.set_result(None)
        return done


class _Counter:
    def __init__(self) -> None:
        self.totals: dict[tuple, int] = {}

    def add(self, value: int, attributes: dict[str, str]) -> None:
        key = tuple(sorted(attributes.items()))
        self.totals[key] = self.totals.get(key, 0) + value


def servicer(host: ChunkHost, dist: DistReceiver | None = None) -> WorkerServicer:
    """A `WorkerServicer` over `host` with its own `DistReceiver` on 127.0.0.1 (metrics: plain counters)."""
    metrics = SimpleNamespace(kv_transfer_bytes=_Counter())
    return WorkerServicer(host, None, WorkerConfig(), metrics, dist=dist or DistReceiver(LOCAL))  # type: ignore[arg-type]


async def serve(service: WorkerServicer) -> grpc_server.RunningServer:
    binding = grpc_server.ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, service, "epd.v1.Worker")
    return await grpc_server.start_server("127.0.0.1", 0, [binding])


async def _main(stall: bool) -> None:
    if stall:
        import services.worker.server as server_module

        async def never_receive(receiver: DistReceiver, message: Any) -> KVChunk:
            print("stalled", flush=True)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        server_module.receive_dist_chunk = never_receive  # type: ignore[assignment]
    running = await serve(servicer(ChunkHost()))
    print(running.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main("stall" in sys.argv[1:]))
