"""KV transfer over a gRPC client stream (`Worker.PushKV`): a prefill worker's chunks out, a decode worker's in.

Beside the embedding transports (services/common/transport_grpc.py): each `KVChunk` the prefill engine made
(services/worker/engine/kv_connector.py) goes as one or more `KVBlocks` messages of at most ~1 MiB, the header
and metas on the first, the first sampled token on the last; `KVAssembler` rebuilds the chunks in order on the
other side. `KVPusher` is the prefill side's one stream per request to its decode worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc

from services.common import tensor_codec
from services.common.rpc.epd.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.transport_grpc import StreamError
from services.worker.engine.kv_connector import FirstToken, KVChunk
from services.worker.engine.request import TokenLogprobs


def _meta(encoded: tensor_codec.EncodedTensor) -> common_pb2.TensorMeta:
    return common_pb2.TensorMeta(dtype=encoded.dtype, shape=list(encoded.shape), nbytes=len(encoded.data))


def chunk_messages(chunk: KVChunk, size: int = tensor_codec.CHUNK_BYTES) -> Iterator[worker_pb2.KVBlocks]:
    """One KV chunk as `KVBlocks` messages (keys' bytes then values', sliced to ``size``)."""
    keys, values = tensor_codec.encode(chunk.keys), tensor_codec.encode(chunk.values)
    pieces = list(tensor_codec.chunks(keys.data + values.data, size))
    for i, piece in enumerate(pieces):
        message = worker_pb2.KVBlocks(request_id=chunk.request_id, data=piece, last=i == len(pieces) - 1)
        if i == 0:
            message.first_block, message.num_tokens = chunk.first_block, chunk.num_tokens
            message.keys.CopyFrom(_meta(keys))
            message.values.CopyFrom(_meta(values))
        if message.last and chunk.first_token is not None:
            first = chunk.first_token
            message.has_first_token, message.first_token, message.rope_delta = True, first.token_id, first.rope_delta
            if first.logprobs is not None:
                message.has_logprobs = True
                lp = first.logprobs
                top = [
                    common_pb2.TopLogprob(token_id=t, logprob=v)
                    for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                ]
                message.first_logprobs.CopyFrom(
                    common_pb2.TokenLogprob(token_id=first.token_id, logprob=lp.logprob, top=top)
                )
        yield message


class KVAssembler:
    """Rebuilds `KVChunk`s from a stream's `KVBlocks` messages (chunks one after another, never interleaved).

    Each chunk's bytes are copied once, into a buffer its header sizes, and its keys and values are views of that
    buffer (`tensor_codec.view`): the decode worker's event loop shares a core with its engine thread, so every
    copy of a burst's KV there is time taken from the decode steps."""

    def __init__(self) -> None:
        self._head: worker_pb2.KVBlocks | None = None
        self._data = bytearray()
        self._filled = 0
        self.total_bytes = 0

    def add(self, message: worker_pb2.KVBlocks) -> KVChunk | None:
        """The chunk ``message`` completes, else None; StreamError on a malformed stream."""
        if self._head is None:
            if not message.HasField("keys"):
                raise StreamError(f"KV chunk of {message.request_id!r} starts without its header")
            self._head = message
            self._data, self._filled = bytearray(message.keys.nbytes + message.values.nbytes), 0
        elif message.request_id != self._head.request_id:
            raise StreamError("KV chunks of two requests interleaved")
        end = self._filled + len(message.data)
        if end > len(self._data):
            raise StreamError(f"KV chunk of {message.request_id!r} carries more bytes than its header says")
        self._data[self._filled : end] = message.data
        self._filled = end
        if not message.last:
            return None
        head, data = self._head, self._data
        if self._filled != len(data):
            raise StreamError(f"KV chunk of {head.request_id!r} ended {len(data) - self._filled} bytes short")
        self._head, self._data, self._filled = None, bytearray(), 0
        self.total_bytes += len(data)
        split = head.keys.nbytes
        keys = tensor_codec.view(head.keys.dtype, tuple(head.keys.shape), data)
        values = tensor_codec.view(head.values.dtype, tuple(head.values.shape), data, split)
        first = None
        if message.has_first_token:
            logprobs = None
            if message.has_logprobs:
                lp = message.first_logprobs
                top_ids, top_logprobs = tuple(t.token_id for t in lp.top), tuple(t.logprob for t in lp.top)
                logprobs = TokenLogprobs(lp.logprob, top_ids, top_logprobs)
            first = FirstToken(message.first_token, logprobs, message.rope_delta)
        return KVChunk(head.request_id, head.first_block, head.num_tokens, keys, values, first)

    def finish(self) -> None:
        if self._head is not None:
            raise StreamError(f"KV stream ended inside a chunk of {self._head.request_id!r}")


class KVPusher:
    """The prefill side of one request: its chunks, as the engine makes them, streamed to the decode worker.

    ``put`` (from the event loop) queues a chunk; ``close`` ends the stream after what is queued; ``ack`` is the
    decode worker's answer (raises grpc.aio.AioRpcError when the stream failed)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, timeout_s: float) -> None:
        self._queue: asyncio.Queue[KVChunk | None] = asyncio.Queue()
        self.bytes = 0
        self._call = stub.PushKV(self._messages(), timeout=timeout_s)

    async def _messages(self) -> AsyncIterator[worker_pb2.KVBlocks]:
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                return
            self.bytes += chunk.nbytes
            for message in chunk_messages(chunk):
                yield message

    def put(self, chunk: KVChunk) -> None:
        self._queue.put_nowait(chunk)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def ack(self) -> worker_pb2.PushAck:
        return await self._call

    def cancel(self) -> None:
        self._call.cancel()


def is_failure(exc: BaseException) -> bool:
    """An error of the push itself (the decode worker gone, refused, past the deadline)."""
    return isinstance(exc, grpc.aio.AioRpcError | StreamError)
