"""This router's relay from each worker: one stream per worker carrying every engine step's tokens for its requests.

The worker's end is services/worker/relay.py. Invariants: a request binds its queue before its Generate call
names the relay, so none of its responses can arrive unseen; each response goes to the queue of the request it
names (one whose attempt ended and unbound is dropped); when the stream ends, every queue still bound gets a
`RelayLost` and the relay is forgotten. A relay is used only once the worker answered its opening (empty)
message: until then, and for a second after one failed to open or ended, requests stream their tokens on their
own Generate call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
REOPEN_AFTER_S = 1.0  # after a relay ended: how long requests use their own streams before one is opened again


@dataclass(frozen=True)
class RelayLost:
    """On a bound request's queue: the relay ended before the request did (the worker went, most likely)."""

    worker: str
    message: str


class WorkerRelay:
    """The relay from one worker: its reading task hands each response to the queue of the request it names."""

    def __init__(self, worker: str, channel: grpc.aio.Channel, relay_id: str) -> None:
        self.worker = worker
        self.relay_id = relay_id
        self.ready = False  # the worker opened it: requests may name it
        self.ended_at = 0.0  # monotonic time the stream ended (0 while it runs)
        self._queues: dict[str, asyncio.Queue] = {}
        self._task = asyncio.create_task(self._read(channel))

    def bind(self, request_id: str) -> asyncio.Queue:
        """The queue `request_id`'s responses (and a `RelayLost`) will arrive on; call before naming the relay."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unbind(self, request_id: str, queue: asyncio.Queue) -> None:
        """Stop delivering ``request_id``'s responses to ``queue``; a queue a later attempt of the same request bound
        since (a migration back to this worker) stays bound."""
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]

    async def _read(self, channel: grpc.aio.Channel) -> None:
        call = worker_pb2_grpc.WorkerStub(channel).Relay(worker_pb2.RelayOpen(relay_id=self.relay_id))
        reason = "the worker ended the relay"
        try:
            if await call.read() is grpc.aio.EOF:
                return
            self.ready = True
            queues = self._queues
            while (batch := await call.read()) is not grpc.aio.EOF:
                for response in batch.responses:
                    queue = queues.get(response.request_id)
                    if queue is not None:
                        queue.put_nowait(response)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the router closed the relay"
            call.cancel()
            raise
        finally:
            self.ready = False
            self.ended_at = time.monotonic()
            queues, self._queues = self._queues, {}
            for queue in queues.values():
                queue.put_nowait(RelayLost(self.worker, f"relay from worker {self.worker} ended ({reason})"))
            log.debug("relay %s from %s ended: %s", self.relay_id, self.worker, reason)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class Relays:
    """This router's relays, one per worker address, opened at first use."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._channel = channel
        self._prefix = uuid.uuid4().hex[:12]  # this router process
        self._opened = 0
        self._relays: dict[str, WorkerRelay] = {}

    def ready(self, worker: str) -> WorkerRelay | None:
        """`worker`'s relay when it is open; else None (and one is opened for the requests that follow)."""
        relay = self._relays.get(worker)
        if relay is not None and relay.ready:
            return relay
        if relay is None or (relay.ended_at and time.monotonic() - relay.ended_at > REOPEN_AFTER_S):
            self._opened += 1
            self._relays[worker] = WorkerRelay(worker, self._channel(worker), f"{self._prefix}-{self._opened}")
        return None

    async def close(self) -> None:
        relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            await relay.close()
