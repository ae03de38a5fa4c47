"""How the router reads a worker's first answer (services/router/worker_stream.py `open_worker`), against real gRPC
servers on 127.0.0.1: admitted, refused (full, draining, or cancelled by a server that is stopping: the call
then goes to the next worker), or failed with a status that names the worker.

The stopping case is real: a call that reaches a gRPC server as it starts `stop(grace)` is cancelled by the
server (CANCELLED "CANCELLED"), which a request migrating off a worker that drained a moment ago can meet
before the router's view of the registry has caught up. The last test makes that race happen.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.router.errors import RequestError
from services.router.relay import WorkerRelay
from services.router.worker_stream import open_worker


class _Worker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, answer: grpc.StatusCode | None, delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s

    async def Generate(self, request, context) -> AsyncIterator[worker_pb2.WorkerResponse]:  # noqa: ANN001, N802
        await asyncio.sleep(self.delay_s)
        if self.answer is not None:
            await context.abort(self.answer, f"answered {self.answer.name}")
        yield worker_pb2.WorkerResponse(admitted=True, state_at=12.5)


async def _serving(servicer: _Worker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _open(answer: grpc.StatusCode | None):
    server, address = await _serving(_Worker(answer))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reserved = await open_worker(
                channel, address, worker_pb2.WorkerRequest(request_id="r"), time.monotonic() + 10
            )
            if reserved is not None:
                reserved.handle.cancel()
            return reserved
    finally:
        await server.stop(None)


def test_an_admitting_worker_gives_its_stream_and_clock() -> None:
    reserved = asyncio.run(_open(None))
    assert reserved is not None and reserved.at == 12.5


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED]
)
def test_full_draining_or_stopping_workers_refuse(code: grpc.StatusCode) -> None:
    assert asyncio.run(_open(code)) is None


def test_another_status_fails_the_request_naming_the_worker() -> None:
    with pytest.raises(RequestError) as caught:
        asyncio.run(_open(grpc.StatusCode.INVALID_ARGUMENT))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith("worker 127.0.0.1:") and "answered INVALID_ARGUMENT" in caught.value.message


async def _race(rounds: int) -> list[str]:
    """Calls sent as their server starts stopping: what `open_worker` made of each (never an error)."""
    outcomes = []
    for _ in range(rounds):
        server, address = await _serving(_Worker(None, delay_s=0.2))
        async with grpc.aio.insecure_channel(address) as channel:
            await channel.channel_ready()
            request = worker_pb2.WorkerRequest(request_id="late")
            opening = asyncio.create_task(open_worker(channel, address, request, time.monotonic() + 10))
            await asyncio.sleep(0)  # the call is on its way
            await server.stop(1.0)
            reserved = await opening
            outcomes.append("admitted" if reserved is not None else "refused")
            if reserved is not None:
                reserved.handle.cancel()
    return outcomes


def test_a_call_meeting_a_stopping_server_is_refused_not_failed() -> None:
    outcomes = asyncio.run(_race(6))
    assert set(outcomes) <= {"admitted", "refused"}


class _Relay:
    """The router's relay as `open_worker` and `WorkerStream` use it: a queue per request, nothing delivered."""

    relay_id = "relay-1"

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}

    def bind(self, request_id: str) -> asyncio.Queue:
        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def unbind(self, request_id: str, queue: asyncio.Queue) -> None:
        if self.queues.get(request_id) is queue:
            del self.queues[request_id]


async def _cancelled_after_the_call_ended() -> str:
    """A relayed attempt whose Generate call ended (its last responses still on their way over the relay) and
    which is then cancelled (its remote prefill failed, its worker vanished): what its next `read` does."""
    server, address = await _serving(_Worker(None))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            relay = _Relay()
            request = worker_pb2.WorkerRequest(request_id="relayed")
            reserved = await open_worker(channel, address, request, time.monotonic() + 10, relay)  # type: ignore[arg-type]
            assert reserved is not None and request.relay_id == relay.relay_id
            stream = reserved.handle
            await asyncio.sleep(0.2)  # the call's end is read: the stream now waits for the relay alone
            stream.cancel()
            assert "relayed" not in relay.queues
            try:
                await asyncio.wait_for(stream.read(), 2.0)
            except asyncio.CancelledError:
                return "cancelled"
            except TimeoutError:
                return "still waiting"
            return "answered"
    finally:
        await server.stop(None)


def test_a_cancelled_stream_whose_call_had_ended_stops_waiting_for_the_relay() -> None:
    """Its relay queue is unbound, so nothing more can arrive: the read raises CancelledError instead of waiting
    out the request's deadline (a remote prefill whose worker was killed before its acknowledgement reached the
    router left such a stream, and the request hung, after its decode worker's call had ended)."""
    assert asyncio.run(_cancelled_after_the_call_ended()) == "cancelled"


class _RelayingWorker(worker_pb2_grpc.WorkerServicer):
    """A worker's relay: the opening message, then one response for request "r" once `send` is set."""

    def __init__(self) -> None:
        self.send = asyncio.Event()

    async def Relay(self, request, context) -> AsyncIterator[worker_pb2.RelayBatch]:  # noqa: ANN001, N802
        yield worker_pb2.RelayBatch()
        await self.send.wait()
        yield worker_pb2.RelayBatch(responses=[worker_pb2.WorkerResponse(request_id="r", token_ids=[7])])
        await asyncio.sleep(5)


async def _later_attempt_after_a_late_unbind() -> list[int]:
    """Attempt 1 of request "r" and then attempt 2 (a migration back to the same worker) bind the relay; attempt 1's
    clean-up unbinds after attempt 2 bound (a failed remote prefill's callback runs a loop turn later): what
    attempt 2's queue then receives."""
    servicer = _RelayingWorker()
    server, address = await _serving(servicer)  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            relay = WorkerRelay(address, channel, "relay-1")
            for _ in range(200):
                if relay.ready:
                    break
                await asyncio.sleep(0.01)
            first, second = relay.bind("r"), relay.bind("r")
            relay.unbind("r", first)
            servicer.send.set()
            response = await asyncio.wait_for(second.get(), 2.0)
            await relay.close()
            return list(response.token_ids)
    finally:
        await server.stop(None)


def test_a_late_unbind_of_an_earlier_attempt_leaves_the_later_one_bound() -> None:
    assert asyncio.run(_later_attempt_after_a_late_unbind()) == [7]
