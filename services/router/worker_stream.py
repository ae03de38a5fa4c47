"""One attempt's responses from its worker: over this router's relay from that worker, or its own Generate call.

The Generate call is the attempt's admission and lifetime either way: it answers `admitted` first, cancelling
it aborts the request there, and an error on it ends the attempt. With a relay (services/router/relay.py) the
tokens arrive on the relay and the call ends after the request's last response was sent there, so the end
of the call alone does not end the stream. Invariants: responses come out in the order the worker sent them;
when several are waiting (the router read slower than the worker stepped), consecutive ones of one choice come
out merged into one (their tokens and logprobs concatenated, the later one's end), so a slow reader does less
work per token, never more; `read` returns None at the end, or raises the call's error (`grpc.aio.AioRpcError`,
`asyncio.CancelledError` once the call was cancelled) or `RelayLostError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import grpc

from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.router.admission import Reserved
from services.router.errors import RequestError
from services.router.relay import RelayLost, WorkerRelay

# A worker's answers before it admitted anything that send the request to the next worker: full, draining, or
# shutting down (a stopping gRPC server cancels the calls it still gets: a migrating request may reach a worker
# that drained a moment ago, before the router's view of the registry caught up).
REFUSALS = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class RelayLostError(Exception):
    """The relay carrying this attempt's tokens ended before the attempt did."""


class _CallEnded:
    """On the queue: the Generate call ended normally."""


class _CallCancelled:
    """On the queue: the Generate call was cancelled."""


_ENDED, _CANCELLED = _CallEnded(), _CallCancelled()


class WorkerStream:
    """An admitted attempt's responses (see the module docstring)."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, relay: WorkerRelay | None, queue: asyncio.Queue, request_id: str
    ) -> None:
        self._call = call
        self._relay = relay
        self._request_id = request_id
        self._queue = queue
        self._held: deque = deque()
        self.kv_skip_blocks = 0  # a remote prefill's decode side: the leading prompt blocks its worker already held
        self._reader = asyncio.create_task(self._read_call())

    async def _read_call(self) -> None:
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._queue.put_nowait(response)
            self._queue.put_nowait(_ENDED)
        except grpc.aio.AioRpcError as exc:
            self._queue.put_nowait(exc)
        except asyncio.CancelledError:
            self._queue.put_nowait(_CANCELLED)

    async def _next(self) -> object:
        return self._held.popleft() if self._held else await self._queue.get()

    async def read(self) -> worker_pb2.WorkerResponse | None:
        """The next response (merged with the waiting ones of its choice), None at the end."""
        while True:
            item = await self._next()
            if isinstance(item, worker_pb2.WorkerResponse):
                return self._merged(item)
            if item is _ENDED:
                if self._relay is None:
                    return None
                continue  # the request's last responses were sent on the relay: wait for them
            if item is _CANCELLED:
                raise asyncio.CancelledError
            if isinstance(item, RelayLost):
                raise RelayLostError(item.message)
            raise item  # the call's AioRpcError

    def _merged(self, response: worker_pb2.WorkerResponse) -> worker_pb2.WorkerResponse:
        prefill_s = response.prefill_s  # the first's: when its first token came
        while not response.finished and (self._held or not self._queue.empty()):
            following = self._held.popleft() if self._held else self._queue.get_nowait()
            if not isinstance(following, worker_pb2.WorkerResponse) or following.index != response.index:
                self._held.appendleft(following)
                break
            response.MergeFrom(following)  # repeated fields append; set scalars (the end, state_at) take the later's
        response.prefill_s = prefill_s
        return response

    def cancel(self) -> None:
        """Abort the request on its worker (cancels the call) and stop taking its responses; a `read` then raises
        CancelledError once the responses already queued are read, even when the call had ended (its end then
        put nothing more, and the relay, unbound, never will)."""
        self._call.cancel()
        if self._relay is not None:
            self._relay.unbind(self._request_id, self._queue)
            self._queue.put_nowait(_CANCELLED)

    async def close(self) -> None:
        self.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def open_worker(
    channel: grpc.aio.Channel,
    worker: str,
    request: worker_pb2.WorkerRequest,
    deadline: float,
    relay: WorkerRelay | None = None,
) -> Reserved[WorkerStream] | None:
    """Open the worker stream on `channel` (naming `relay` when given) and wait for admission: the stream when the
    worker admitted the request; None when it refused (one of `REFUSALS`, or it ended without admitting);
    RequestError naming the worker for any other status."""
    queue = relay.bind(request.request_id) if relay is not None else asyncio.Queue()
    request.relay_id = relay.relay_id if relay is not None else ""
    timeout = max(0.001, deadline - time.monotonic())
    call = worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=timeout)
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        if relay is not None:
            relay.unbind(request.request_id, queue)
        if exc.code() in REFUSALS:
            return None
        raise RequestError(exc.code(), f"worker {worker}: {exc.details()}") from exc
    except BaseException:
        call.cancel()
        if relay is not None:
            relay.unbind(request.request_id, queue)
        raise
    if first is grpc.aio.EOF or not first.admitted:
        call.cancel()
        if relay is not None:
            relay.unbind(request.request_id, queue)
        return None
    stream = WorkerStream(call, relay, queue, request.request_id)
    stream.kv_skip_blocks = first.kv_skip_blocks
    return Reserved(stream, first.state_at)
