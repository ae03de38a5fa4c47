"""A worker's embedding-receiving side in its own process, for transfer tests and the encoder bench.

`ReceiverProcess` starts (spawn) a gRPC server whose `Worker` servicer answers `PushEmbeddings`,
`DistConnect` and `PushDist` with the worker's own handlers (services/worker/push_receiver.py). It keeps
what arrives, and answers digests (sha256 over dtype, shape and raw bytes) over a pipe, so a test can
prove the bytes arrived unchanged without the engine or a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from services.common import grpc_server
from services.common.dist_receiver import DistReceiver, ReceiverAddress
from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.worker.push_receiver import PushReceiver


def digest(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    header = f"{tensor.dtype}|{list(tensor.shape)}|".encode()
    return hashlib.sha256(header + flat.numpy().tobytes()).hexdigest()


class _Receiver(worker_pb2_grpc.WorkerServicer):
    """The worker's own PushEmbeddings / DistConnect / PushDist handlers (`PushReceiver`), storing into a dict."""

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.pushes = PushReceiver(self.received.__setitem__, DistReceiver(ReceiverAddress("127.0.0.1", "127.0.0.1")))

    async def PushEmbeddings(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> worker_pb2.PushAck:
        return await self.pushes.push_embeddings(request_iterator, context)

    async def DistConnect(
        self, request: worker_pb2.DistConnectRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DistConnectReply:
        return await self.pushes.dist_connect(request, context)

    async def PushDist(self, request: worker_pb2.DistTransfer, context: grpc.aio.ServicerContext) -> worker_pb2.PushAck:
        return await self.pushes.push_dist(request, context)


async def _serve(conn: Any) -> None:
    receiver = _Receiver()
    binding = grpc_server.ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, receiver, "epd.v1.Worker")
    running = await grpc_server.start_server("127.0.0.1", 0, [binding])
    conn.send(f"127.0.0.1:{running.port}")
    while True:
        command, argument = await asyncio.to_thread(conn.recv)
        if command == "stop":
            break
        tensor = receiver.received.get(argument)
        conn.send(None if tensor is None else digest(tensor))
    receiver.pushes.dist.close()
    await running.stop(0.5)


def _main(conn: Any) -> None:
    asyncio.run(_serve(conn))


class ReceiverProcess:
    """The receiver in a child process; `address` is its gRPC host:port. Use as a context manager."""

    def __init__(self, start_timeout_s: float = 300.0) -> None:  # a spawn importing torch at load 13 took > 60 s
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_main, args=(child,), daemon=True, name="epd-receiver")
        self._process.start()
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise RuntimeError("the receiver process did not start")
        self.address: str = self._conn.recv()

    def digest(self, mm_hash: str, timeout_s: float = 30.0) -> str | None:
        """The digest of what arrived under `mm_hash`, or None when nothing did."""
        self._conn.send(("digest", mm_hash))
        if not self._conn.poll(timeout_s):
            raise TimeoutError("the receiver process did not answer")
        return self._conn.recv()

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(("stop", ""))
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def start_redis() -> Iterator[str]:
    """A private redis-server on a free port for the bench; yields its URL."""
    from services.launch.local import free_port
    from tests.integration.conftest import RedisServer

    server = RedisServer(free_port())
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
