"""KV transfer between workers: a prefill worker's chunks out, a decode worker's in, on a `Worker.PushKV` stream.

Beside the embedding transports (services/common/transport_grpc.py, transport_dist.py): `KVPusher` is the prefill
side's one stream per request to its decode worker, and each `KVChunk` the prefill engine made
(services/worker/engine/kv_connector.py) goes by the worker's KV transport (`EPD_KV_TRANSPORT`, `kv_transport`):
- `grpc` (`GrpcKV`): the chunk as one or more `KVBlocks` messages of at most ~1 MiB, the header and metas on the
  first, the first sampled token on the last; `KVAssembler` rebuilds the chunks in order on the other side.
- `dist` (`DistKV`): the chunk as one `KVBlocks` message without data (header, metas, first token, the pair and
  two tags) and its keys' and values' bytes by send/recv on the torch.distributed (gloo) pair the prefill worker
  keeps with that decode worker (`SenderPairs`), received on the pair's thread into one buffer allocated per chunk
  (`receive_dist_chunk`): the decode worker's event loop never handles the bytes.

Invariants: a stream's chunks go one after another, never interleaved. Over `dist`, the pair's lock is held from
a chunk's control message until its bytes were received (gloo's send waits for the matching recv), so the decode
worker posts its recvs in the order the prefill worker sends; a chunk once begun is finished before its stream is
cancelled (its control message is out and the decode worker waits for its bytes). A pair that fails or times out
ends that push with DistError (the prefill answers UNAVAILABLE; the decode worker's KV deadline and the router's
local-prefill fallback take it from there) and is dropped; one that cannot be made sends the chunk inline over
gRPC instead and the peer is not tried again for `RETRY_PAIR_S`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
import torch

from services.common import tensor_codec
from services.common.dist_receiver import DistReceiver
from services.common.dist_sender import SenderPairs
from services.common.rpc.epd.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.transport_dist import DistError, tensor_spec
from services.common.transport_grpc import StreamError
from services.worker.engine.kv_connector import FirstToken, KVChunk
from services.worker.engine.request import TokenLogprobs

log = logging.getLogger(__name__)
RETRY_PAIR_S = 30.0
"""After a failed pair set-up with a decode worker, its chunks go inline over gRPC this long before a new try."""
_PAIR_SETUP_S = 10.0  # the longest a pair's set-up may take (a LAN rendezvous takes milliseconds)


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
        if message.last:
            _set_first_token(message, chunk.first_token)
        yield message


def _set_first_token(message: worker_pb2.KVBlocks, first: FirstToken | None) -> None:
    if first is None:
        return
    message.has_first_token, message.first_token, message.rope_delta = True, first.token_id, first.rope_delta
    if first.logprobs is not None:
        message.has_logprobs = True
        lp = first.logprobs
        top = [common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        message.first_logprobs.CopyFrom(common_pb2.TokenLogprob(token_id=first.token_id, logprob=lp.logprob, top=top))


def _first_token(message: worker_pb2.KVBlocks) -> FirstToken | None:
    if not message.has_first_token:
        return None
    logprobs = None
    if message.has_logprobs:
        lp = message.first_logprobs
        top_ids, top_logprobs = tuple(t.token_id for t in lp.top), tuple(t.logprob for t in lp.top)
        logprobs = TokenLogprobs(lp.logprob, top_ids, top_logprobs)
    return FirstToken(message.first_token, logprobs, message.rope_delta)


def dist_message(chunk: KVChunk, pair_id: str, keys_tag: int, values_tag: int) -> worker_pb2.KVBlocks:
    """A chunk's one `KVBlocks` message over torch.distributed: everything but its bytes, which go on the pair."""
    message = worker_pb2.KVBlocks(
        request_id=chunk.request_id,
        first_block=chunk.first_block,
        num_tokens=chunk.num_tokens,
        keys=_tensor_meta(chunk.keys),
        values=_tensor_meta(chunk.values),
        last=True,
        pair_id=pair_id,
        keys_tag=keys_tag,
        values_tag=values_tag,
    )
    _set_first_token(message, chunk.first_token)
    return message


def _tensor_meta(tensor: torch.Tensor) -> common_pb2.TensorMeta:
    dtype = tensor_codec.dtype_name(tensor.dtype)
    return common_pb2.TensorMeta(dtype=dtype, shape=list(tensor.shape), nbytes=tensor.numel() * tensor.element_size())


async def receive_dist_chunk(receiver: DistReceiver, message: worker_pb2.KVBlocks) -> KVChunk:
    """The chunk `message` (a `dist_message`) names, its bytes received on its pair's thread into one buffer
    allocated for the chunk (keys and values are views of it); DistError when the pair fails or times out (the
    pair is then dropped), StreamError for a malformed header."""
    try:
        (keys_dtype, keys_shape), (values_dtype, values_shape) = tensor_spec(message.keys), tensor_spec(message.values)
    except DistError as exc:
        raise StreamError(f"KV chunk of {message.request_id!r}: {exc}") from None
    split, total = message.keys.nbytes, message.keys.nbytes + message.values.nbytes
    if split % values_dtype.itemsize:
        raise StreamError(f"KV chunk of {message.request_id!r}: values at byte {split} are unaligned")
    buffer = torch.empty(total, dtype=torch.uint8, device=receiver.device_for(message.pair_id))
    keys = buffer[:split].view(keys_dtype).view(keys_shape)
    values = buffer[split:].view(values_dtype).view(values_shape)
    await receiver.receive_into(message.pair_id, [(keys, message.keys_tag), (values, message.values_tag)])
    first = _first_token(message)
    return KVChunk(message.request_id, message.first_block, message.num_tokens, keys, values, first)


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
        return KVChunk(head.request_id, head.first_block, head.num_tokens, keys, values, _first_token(message))

    def finish(self) -> None:
        """StreamError when the stream stopped inside a chunk (the stream's end, or a `dist` chunk's message)."""
        if self._head is not None:
            raise StreamError(f"KV stream ended inside a chunk of {self._head.request_id!r}")


class KVTransport(Protocol):
    """How a `KVPusher` sends one chunk on its stream. ``atomic``: a chunk begun must be finished before the stream
    is cancelled (its bytes travel apart from the stream and the receiver waits for them)."""

    name: str
    atomic: bool

    async def send(self, call: Any, peer: str, chunk: KVChunk) -> str:
        """Send ``chunk``; the name of the transport that carried its bytes (a fallback's, when it fell back)."""
        ...

    def close(self) -> None: ...


class GrpcKV:
    """The `grpc` KV transport: each chunk as ~1 MiB `KVBlocks` messages on the stream itself."""

    name = "grpc"
    atomic = False

    async def send(self, call: Any, peer: str, chunk: KVChunk) -> str:
        for message in chunk_messages(chunk):
            await call.write(message)
        return self.name

    def close(self) -> None:
        pass


class DistKV:
    """The `dist` KV transport: one gloo pair per decode worker (`SenderPairs`), the chunks' bytes sent on it (see
    the module invariants). ``inline_chunks``: chunks sent inline over gRPC because no pair could be made."""

    name = "dist"
    atomic = True

    def __init__(self, pairs: SenderPairs) -> None:
        self.pairs = pairs
        self._retry_at: dict[str, float] = {}
        self.inline_chunks = 0

    async def send(self, call: Any, peer: str, chunk: KVChunk) -> str:
        async with self.pairs.lock(peer):
            pair = await self._pair(peer)
            if pair is not None:
                keys_tag, values_tag = pair.next_tag(), pair.next_tag()
                await call.write(dist_message(chunk, pair.pair_id, keys_tag, values_tag))
                sent = pair.send([(chunk.keys, keys_tag), (chunk.values, values_tag)])
                try:
                    await _bounded(sent, 2 * self.pairs.timeout_s, f"sending KV to {peer}")
                except DistError:
                    self.pairs.drop(peer, pair)
                    raise
                return self.name
        self.inline_chunks += 1
        return await GRPC_KV.send(call, peer, chunk)

    async def _pair(self, peer: str) -> Any:
        """The live pair with ``peer``, made now if need be; None (and no new try for `RETRY_PAIR_S`) when that
        fails."""
        if time.monotonic() < self._retry_at.get(peer, 0.0):
            return None
        try:
            return await self.pairs.pair(peer, min(self.pairs.timeout_s, _PAIR_SETUP_S))
        except (DistError, grpc.aio.AioRpcError, OSError) as exc:
            self._retry_at[peer] = time.monotonic() + RETRY_PAIR_S
            log.warning("KV pair with %s failed (%s): its chunks go over gRPC for %gs", peer, exc, RETRY_PAIR_S)
            return None

    def close(self) -> None:
        self.pairs.close()


async def _bounded(future: Any, timeout_s: float, what: str) -> Any:
    """`future` (a concurrent one, on a pair's thread) within ``timeout_s``; never cancelled by a cancel of the
    awaiting task or by the timeout: it is running on the pair and ends there (bounded by the pair's timeout)."""
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
    except TimeoutError:
        raise DistError(f"{what} timed out after {timeout_s:.1f}s") from None
    except DistError:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise DistError(f"{what} failed: {exc}") from exc


GRPC_KV = GrpcKV()


def kv_transport(name: str, stub: Callable[[str], Any], hostname: str, timeout_s: float) -> KVTransport:
    """The KV transport a prefill worker's `kv_transport` setting names (``stub(address)``: a decode worker's)."""
    if name == "dist":
        return DistKV(SenderPairs(stub, "gloo", hostname, timeout_s))
    if name == "grpc":
        return GRPC_KV
    raise ValueError(f"unknown KV transport {name!r}")


class KVPusher:
    """The prefill side of one request: its chunks, as the engine makes them, sent to the decode worker on one
    `PushKV` stream by ``transport`` (default gRPC).

    ``put`` (from the event loop) queues a chunk; ``close`` ends the stream after what is queued; ``ack`` is the
    decode worker's answer (raises grpc.aio.AioRpcError when the stream failed, DistError when a pair did: see
    `is_failure`); ``bytes`` the bytes sent so far by the name of the transport that carried them. Made on a running
    event loop."""

    def __init__(
        self, stub: worker_pb2_grpc.WorkerStub, timeout_s: float, transport: KVTransport = GRPC_KV, peer: str = ""
    ) -> None:
        self._queue: asyncio.Queue[KVChunk | None] = asyncio.Queue()
        self.bytes: collections.Counter[str] = collections.Counter()
        self._transport, self._peer = transport, peer
        self._call = stub.PushKV(timeout=timeout_s)
        self._current: asyncio.Future | None = None  # the chunk being sent
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(_retrieve)

    async def _run(self) -> None:
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                break
            current = self._current = asyncio.ensure_future(self._transport.send(self._call, self._peer, chunk))
            current.add_done_callback(_retrieve)
            carried = await (asyncio.shield(current) if self._transport.atomic else current)
            self.bytes[carried] += chunk.nbytes
        await self._call.done_writing()

    def put(self, chunk: KVChunk) -> None:
        self._queue.put_nowait(chunk)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def ack(self) -> worker_pb2.PushAck:
        try:
            await self._task
        except Exception:
            if self._call.done():
                return await self._call  # the stream's own failure (raises its AioRpcError)
            self._call.cancel()
            raise
        return await self._call

    def cancel(self) -> None:
        self._task.cancel()
        current = self._current
        if self._transport.atomic and current is not None and not current.done():
            current.add_done_callback(lambda _: self._call.cancel())  # its bytes are on their way: let them land
        else:
            self._call.cancel()


def _retrieve(task: asyncio.Future) -> None:
    """A done callback: take a task's exception (ack, or nobody after a cancel, sees it)."""
    if not task.cancelled():
        task.exception()


def is_failure(exc: BaseException) -> bool:
    """An error of the push itself (the decode worker gone, refused, past the deadline, a failed pair)."""
    return isinstance(exc, grpc.aio.AioRpcError | StreamError | DistError)
