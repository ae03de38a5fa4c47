"""The SSE response's own disconnect watch: a client that leaves ends the sending and closes the body generator;
a server that stops (the task cancelled, the client still there) is not swallowed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.router.http_exchange import EventStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


class Body:
    """An endless event generator that records whether it was closed."""

    def __init__(self) -> None:
        self.sent = 0
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                self.sent += 1
                yield b"data: x\n\n"
                await asyncio.sleep(0.001)
        finally:
            self.closed = True


def test_a_client_that_leaves_ends_the_stream_and_closes_the_generator() -> None:
    async def main() -> Body:
        body, left = Body(), asyncio.Event()
        messages: list[dict] = []

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.append(message)
            if len(messages) == 4:  # the start and three events: then the client goes
                left.set()

        await asyncio.wait_for(EventStream(body.events())(SCOPE, receive, send), 5)  # returns: nothing raised
        assert messages[0]["type"] == "http.response.start"
        return body

    body = asyncio.run(main())
    assert body.closed and 3 <= body.sent <= 5


def test_a_stopping_server_cancels_it_and_the_cancellation_propagates() -> None:
    async def main() -> Body:
        body = Body()

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client never leaves
            return {}

        async def send(message: dict) -> None:
            return None

        task = asyncio.create_task(EventStream(body.events())(SCOPE, receive, send))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return body

    body = asyncio.run(main())
    assert body.closed and body.sent > 1
