"""`guarded`, the HTTP API's wait for a generation: the work runs in the handler's own task (a refusal decided
without waiting is answered in the same step of the event loop), a client that leaves cancels it (ClientGone),
the deadline cancels it (504), and a cancellation of the handler itself is not mistaken for either."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from services.router.http_errors import HttpError
from services.router.http_exchange import ClientGone, guarded


class Client:
    """The ASGI `receive` of a client whose body was read: it waits until `leave()`, then says it left."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, self.receive)


class Work:
    """A generation's first step: it refuses at once, or waits on `release`; `ended` says how it ended."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.release = asyncio.Event()
        self.ended = ""

    async def run(self) -> str:
        if self.refuse:
            self.ended = "refused"
            raise ValueError("refused on arrival")
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        self.ended = "answered"
        return "first"


def test_a_refusal_is_answered_in_the_same_step_of_the_loop() -> None:
    async def go() -> list[str]:
        order: list[str] = []
        asyncio.get_running_loop().call_soon(order.append, "the loop's next callback")
        with pytest.raises(ValueError):
            await guarded(Client().request(), Work(refuse=True).run(), 5.0)
        order.append("refused")
        await asyncio.sleep(0)
        return order

    assert asyncio.run(go()) == ["refused", "the loop's next callback"]


def test_the_answer_comes_back_and_nothing_is_left_running() -> None:
    async def go() -> tuple[str, int]:
        work = Work()
        asyncio.get_running_loop().call_later(0.01, work.release.set)
        answer = await guarded(Client().request(), work.run(), 5.0)
        await asyncio.sleep(0.01)
        return answer, len(asyncio.all_tasks())

    assert asyncio.run(go()) == ("first", 1)  # the watcher is gone: only this task


def test_a_client_that_leaves_cancels_the_work() -> None:
    async def go() -> Work:
        client, work = Client(), Work()
        asyncio.get_running_loop().call_later(0.01, client.left.set)
        with pytest.raises(ClientGone):
            await guarded(client.request(), work.run(), 5.0)
        assert asyncio.current_task().cancelling() == 0  # the handler goes on to answer 499
        await asyncio.sleep(0)
        return work

    assert asyncio.run(go()).ended == "cancelled"


def test_the_deadline_cancels_the_work_and_is_504() -> None:
    async def go() -> Work:
        work = Work()
        with pytest.raises(HttpError) as info:
            await guarded(Client().request(), work.run(), 0.02)
        assert info.value.status == 504
        return work

    assert asyncio.run(go()).ended == "cancelled"


def test_the_handler_cancelled_is_not_a_client_gone() -> None:
    async def go() -> Work:
        work = Work()
        handler = asyncio.ensure_future(guarded(Client().request(), work.run(), 5.0))
        await asyncio.sleep(0.01)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        return work

    assert asyncio.run(go()).ended == "cancelled"
