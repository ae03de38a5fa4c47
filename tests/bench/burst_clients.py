"""`epd bench burst`'s clients: when each token of a stream arrives (`Stream`, `consume`), and the image requests
sent from a process of their own (`ImageSender`)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.client import user_request
from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import generation_pb2_grpc


@dataclass
class Stream:
    """When each token of one request arrived (perf_counter seconds), and how many messages carried several."""

    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    coalesced: int = 0


async def consume(
    stub: generation_pb2_grpc.GenerationStub, request, into: Stream, ready: asyncio.Event | None, quiet_tokens: int
) -> None:
    into.sent = time.perf_counter()
    async for response in stub.Generate(request, timeout=600):
        if not response.HasField("chunk"):
            continue
        now = time.perf_counter()
        n = len(response.chunk.token_ids)
        into.token_times.extend([now] * n)
        into.coalesced += n > 1
        if ready is not None and len(into.token_times) >= quiet_tokens:
            ready.set()


class ImageSender:
    """The image requests come from a process of their own, as from other users: sending eight large requests
    from the measuring client's event loop would delay its reading of the streams' tokens, and that delay is
    the client's, not the cluster's. Token times are ``time.perf_counter()`` in both processes (the system's
    monotonic clock on Linux, so they compare)."""

    def __init__(self, address: str, images: list[bytes]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_sender_main, args=(child, address, images), daemon=True)
        self._process.start()
        child.close()

    async def ready(self) -> None:
        if await asyncio.to_thread(self._conn.recv) != "ready":
            raise RuntimeError("the image sender did not start")

    async def burst(self, salt: str, max_tokens: int) -> list[Stream]:
        """Every image sent at once with ``salt``; returns when all answered."""
        self._conn.send((salt, max_tokens))
        answer = await asyncio.to_thread(self._conn.recv)
        if isinstance(answer, str):
            raise RuntimeError(f"the image sender failed: {answer}")
        return answer

    async def close(self) -> None:
        self._conn.send(None)
        await asyncio.to_thread(self._process.join, 30)
        self._conn.close()


def _sender_main(conn: Any, address: str, images: list[bytes]) -> None:
    asyncio.run(_send_bursts(conn, address, images))


async def _send_bursts(conn: Any, address: str, images: list[bytes]) -> None:
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in images]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    await asyncio.gather(*(c.channel_ready() for c in channels))
    conn.send("ready")
    while (job := await asyncio.to_thread(conn.recv)) is not None:
        salt, max_tokens = job
        streams = [Stream() for _ in images]
        try:
            await asyncio.gather(
                *(
                    consume(stub, _image_request(i, data, salt, max_tokens), stream, None, 0)
                    for i, (stub, data, stream) in enumerate(zip(stubs, images, streams, strict=True))
                )
            )
        except grpc.aio.AioRpcError as exc:
            conn.send(f"{exc.code().name}: {exc.details()}")
            continue
        conn.send(streams)
    await asyncio.gather(*(c.close() for c in channels))


def _image_request(i: int, data: bytes, salt: str, max_tokens: int):
    request = user_request(f"image {i}: describe it", [data], max_tokens=max_tokens, cache_salt=salt)
    request.sampling.ignore_eos = True
    return request
