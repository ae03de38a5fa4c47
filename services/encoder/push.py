"""Pushing a request's embeddings to its worker: gRPC client stream or torch.distributed send.

`Pusher.push` picks the configured transport. With `dist`, a pair (2-rank process group) per
worker is made on first use and reused; gRPC carries the control message (`PushDist`) while the
bytes go by `send` on the pair's thread.

Invariants:
- A push returns only after the worker acked every item, or raises `PushError` naming the worker
  and the cause within `timeout_s` (every await is bounded).
- A failed dist push closes its pair (the next push makes a new one) and is retried once over
  gRPC; only when that fails too does the request fail.
- One dist push per worker at a time (an asyncio lock per address), so a pair's control messages
  and sends can never cross.
- Tensors are sent from where they are when that is the transport's device (`Pusher.device`: the GPU
  for dist over NCCL, the host otherwise): callers hand over device tensors for NCCL, host copies
  for the rest, and the pair moves only what is elsewhere (a cache hit to the GPU for NCCL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from services.common import tensor_codec
from services.common.dist_sender import SenderPairs
from services.common.rpc.epd.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.tls import ClientTls, Dialer
from services.common.transport_dist import DistError, PairChannel, wait_bounded
from services.common.transport_grpc import Embedding, iter_chunks


class PushError(RuntimeError):
    """The worker did not receive the embeddings; the message names it and the cause."""


@dataclass(frozen=True)
class PushResult:
    """How a push went: the transport that delivered it, bytes, seconds, and whether dist fell back."""

    transport: str
    bytes: int
    seconds: float
    fell_back: bool = False


class Channels:
    """One gRPC channel per worker address (mTLS when `tls`: services/common/tls.py), closed together."""

    def __init__(self, tls: ClientTls | None = None) -> None:
        self._dialer = Dialer(tls)

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._dialer.channel(address))

    async def close(self) -> None:
        await self._dialer.close()


async def push_grpc(channels: Channels, address: str, embeddings: list[Embedding], timeout_s: float) -> int:
    """Stream `embeddings` in ~1 MiB chunks; returns the bytes the worker acked.

    Device tensors (a dist-over-NCCL push falling back) are copied to the host on a thread first.
    """
    if any(e.tensor.device.type != "cpu" for e in embeddings):
        embeddings = await asyncio.to_thread(_on_host, embeddings)
    try:
        ack = await channels.stub(address).PushEmbeddings(iter_chunks(embeddings), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise PushError(f"gRPC push to worker {address} failed: {exc.code().name}: {exc.details()}") from exc
    return int(ack.bytes)


def _on_host(embeddings: list[Embedding]) -> list[Embedding]:
    return [Embedding(e.mm_hash, e.tensor.cpu()) for e in embeddings]


class DistPush:
    """The encoder side of the torch.distributed transport (see module invariants); its pairs are
    `SenderPairs` (services/common/dist_sender.py), one per worker."""

    def __init__(
        self,
        channels: Channels,
        backend: str,
        hostname: str,
        timeout_s: float,
        device: str | torch.device | None = None,
    ) -> None:
        self._channels = channels
        self._timeout_s = timeout_s
        self.pairs = SenderPairs(channels.stub, backend, hostname, timeout_s, device)
        self.device = self.pairs.device

    async def push(self, address: str, embeddings: list[Embedding], timeout_s: float) -> int:
        """Send `embeddings` to the worker at `address`; returns bytes sent. Raises PushError."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self.pairs.lock(address):
                    pair = await self.pairs.pair(address, timeout_s)
                    try:
                        return await self._send(pair, address, embeddings, timeout_s)
                    except BaseException:
                        self.pairs.drop(address, pair)
                        raise
        except TimeoutError:
            raise PushError(f"dist push to worker {address} timed out after {timeout_s:.1f}s") from None
        except DistError as exc:
            raise PushError(f"dist push to worker {address} failed: {exc}") from exc
        except grpc.aio.AioRpcError as exc:
            raise PushError(f"dist push to worker {address} failed: {exc.code().name}: {exc.details()}") from exc

    async def _send(self, pair: PairChannel, address: str, embeddings: list[Embedding], timeout_s: float) -> int:
        items, sends = [], []
        for embedding in embeddings:
            tag = pair.next_tag()
            tensor = embedding.tensor
            meta = common_pb2.TensorMeta(
                dtype=tensor_codec.dtype_name(tensor.dtype),
                shape=list(tensor.shape),
                nbytes=tensor.numel() * tensor.element_size(),
            )
            items.append(worker_pb2.DistItem(mm_hash=embedding.mm_hash, meta=meta, tag=tag))
            sends.append((tensor, tag))
        control = self._channels.stub(address).PushDist(
            worker_pb2.DistTransfer(pair_id=pair.pair_id, items=items, timeout_s=self._timeout_s), timeout=timeout_s
        )
        sent = wait_bounded(pair.send(sends), timeout_s, f"sending to {address}")
        _, nbytes = await asyncio.gather(control, sent)
        return int(nbytes)

    def close(self) -> None:
        self.pairs.close()


class Pusher:
    """Pushes by the configured transport; `on_result` feeds metrics."""

    def __init__(
        self,
        transport: str,
        dist: DistPush | None,
        channels: Channels,
        on_result: Callable[[PushResult], None] | None = None,
    ) -> None:
        if transport == "dist" and dist is None:
            raise ValueError("transport 'dist' needs a DistPush")
        self._transport = transport
        self._dist = dist
        self._channels = channels
        self._on_result = on_result or (lambda result: None)

    @property
    def device(self) -> torch.device:
        """Where pushed tensors are best handed over: the pair's GPU for dist over NCCL (sent from there,
        no host round trip), else the host (gRPC and gloo send host bytes)."""
        if self._transport == "dist" and self._dist is not None:
            return self._dist.device
        return torch.device("cpu")

    async def push(self, address: str, embeddings: list[Embedding], timeout_s: float) -> PushResult:
        start = time.perf_counter()
        fell_back = False
        if self._transport == "dist" and self._dist is not None:
            try:
                nbytes = await self._dist.push(address, embeddings, timeout_s)
                return self._done(PushResult("dist", nbytes, time.perf_counter() - start))
            except PushError:
                fell_back = True
                timeout_s = max(0.5, timeout_s - (time.perf_counter() - start))
        nbytes = await push_grpc(self._channels, address, embeddings, timeout_s)
        return self._done(PushResult("grpc", nbytes, time.perf_counter() - start, fell_back))

    def _done(self, result: PushResult) -> PushResult:
        self._on_result(result)
        return result

    async def close(self) -> None:
        if self._dist is not None:
            self._dist.close()
        await self._channels.close()
