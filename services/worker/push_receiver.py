"""What encoders push to a worker: embeddings as a gRPC chunk stream or over a torch.distributed pair, and the pairs.

The worker's `PushEmbeddings`, `DistConnect` and `PushDist` handlers, and the stand-in receiver the transfer tests
and the encoder bench run (tests/bench/receiver.py), are these methods. Invariants: each whole embedding that
arrives is handed to `put` once, in arrival order, and stays there when a later one fails; a malformed chunk stream
ends INVALID_ARGUMENT, a torch.distributed pair that cannot be set up or a transfer that fails UNAVAILABLE; the
bytes of a push are counted (`count`, by transport) only once all of it arrived. A pair set up here also serves
the KV chunks a prefill worker pushes (the worker's `PushKV`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import torch

from services.common.dist_receiver import DistReceiver
from services.common.rpc.epd.v1 import worker_pb2
from services.common.transport_dist import DistError
from services.common.transport_grpc import ChunkAssembler, StreamError


def _uncounted(nbytes: int, transport: str) -> None:
    return None


class PushReceiver:
    """Receives pushed embeddings into `put(mm_hash, tensor)`; `dist` holds this service's torch.distributed pairs."""

    def __init__(
        self,
        put: Callable[[str, torch.Tensor], None],
        dist: DistReceiver,
        count: Callable[[int, str], None] = _uncounted,
    ) -> None:
        self._put = put
        self.dist = dist
        self._count = count

    async def push_embeddings(
        self, request_iterator: AsyncIterator[worker_pb2.EmbeddingChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushAck:
        """`PushEmbeddings`: the chunks of one or more embeddings, each reassembled (`ChunkAssembler`) and put."""
        assembler = ChunkAssembler()
        items = 0
        try:
            async for chunk in request_iterator:
                embedding = assembler.add(chunk)
                if embedding is not None:
                    self._put(embedding.mm_hash, embedding.tensor)
                    items += 1
            assembler.finish()
            self._count(assembler.total_bytes, "grpc")
        except (StreamError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad embedding stream: {exc}")
        return worker_pb2.PushAck(items=items, bytes=assembler.total_bytes)

    async def dist_connect(
        self, request: worker_pb2.DistConnectRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DistConnectReply:
        """`DistConnect`: set up the torch.distributed pair a sender asks for."""
        try:
            return self.dist.connect(request)
        except (DistError, RuntimeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"torch.distributed pair set-up failed: {exc}")

    async def push_dist(
        self, request: worker_pb2.DistTransfer, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushAck:
        """`PushDist`: the embeddings a transfer on a pair carries, each put."""
        try:
            embeddings = await self.dist.receive(request)
        except DistError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"torch.distributed push failed: {exc}")
        for embedding in embeddings:
            self._put(embedding.mm_hash, embedding.tensor)
        nbytes = sum(e.tensor.nbytes for e in embeddings)
        self._count(nbytes, "dist")
        return worker_pb2.PushAck(items=len(embeddings), bytes=nbytes)
