"""A router's relay on this worker: one stream carrying the tokens of all that router's requests, a message per step.

Why: a message per token per request made the router's gRPC reads (and the worker's writes) the largest part of
relaying a token; one message per engine step for every request of a router costs one read however many
requests run. Invariants: one request's responses keep their order; everything sent before `close` is written
before the stream ends, unless the router went; `close` ends every request still bound with `RelayClosed` on
its output queue (its Generate call answers UNAVAILABLE, so its router migrates it), and nothing is sent after.
While the router reads slower than the engine steps, the responses of several steps go in one message.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from services.common.rpc.epd.v1 import worker_pb2


@dataclasses.dataclass(frozen=True)
class RelayClosed:
    """On a request's output queue: the relay carrying its tokens closed (its router went, or cancelled it)."""

    relay_id: str


class Relay:
    """One router's relay: requests bind to it, their responses are batched into `RelayBatch` messages."""

    def __init__(self, relay_id: str) -> None:
        self.relay_id = relay_id
        self._pending: list[worker_pb2.WorkerResponse] = []
        self._ready = asyncio.Event()
        self._bound: dict[str, asyncio.Queue] = {}  # request id -> its output queue (close ends them)
        self.closed = False

    def bind(self, request_id: str, outputs: asyncio.Queue) -> None:
        self._bound[request_id] = outputs

    def unbind(self, request_id: str, outputs: asyncio.Queue) -> None:
        """Forget ``outputs`` as ``request_id``'s; a later attempt of the same request bound since stays bound."""
        if self._bound.get(request_id) is outputs:
            del self._bound[request_id]

    def send(self, response: worker_pb2.WorkerResponse) -> None:
        """Queue `response` (its `request_id` set) for the next message."""
        self._pending.append(response)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()
        bound, self._bound = self._bound, {}
        for outputs in bound.values():
            outputs.put_nowait(RelayClosed(self.relay_id))

    async def batches(self) -> AsyncIterator[worker_pb2.RelayBatch]:
        """The Relay stream's messages: an empty one (open), then whatever was sent, batched, until `close`."""
        yield worker_pb2.RelayBatch()
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._pending:
                batch, self._pending = self._pending, []
                yield worker_pb2.RelayBatch(responses=batch)
            if self.closed:
                return
