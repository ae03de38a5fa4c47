"""One HTTP exchange's I/O: the body read within its limit and parsed into its model, work guarded against a client
that leaves or the deadline, and a generation's answer collected whole or written as server-sent events.

Invariants: a body is refused (413) as soon as it is known to pass its limit, before the rest is read; guarded
work is cancelled whenever its answer is not given (the client left: `ClientGone`; the deadline: 504), which
cancels its generation and frees its KV blocks; an event stream closes its generator on every exit, and a
failure after the status line went out is sent as an error event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.types import Receive, Scope, Send

from services.common.rpc.epd.v1 import generation_pb2
from services.router.constraint_size import ConstraintTooLarge, oversized_in_body
from services.router.errors import RequestError
from services.router.http_errors import HttpError, from_request_error, from_validation, internal, too_large_body
from services.router.openai_response import DONE, ChunkWriter, CompletionBuilder, sse, sse_all
from services.router.openai_structured import MAX_CONSTRAINT_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")


def max_body_bytes(max_request_bytes: int) -> int:
    """Largest JSON body accepted: the media bytes allowed per request as base64, plus 1 MiB of text."""
    return max_request_bytes * 4 // 3 + (1 << 20)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events; the body generator is closed on every exit, a dropped client included.

    While the events go out, a task of its own waits for the client to leave and then cancels the sending (which
    closes the generator, so the generation is cancelled and its blocks freed): Starlette's `StreamingResponse`
    runs the same two through an anyio task group, a cancel scope and a task more, on every response."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.current_task()
        assert sending is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await _disconnected(receive)
            gone = True
            sending.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise  # the server is stopping: not ours to swallow
            sending.uncancel()
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()


async def _disconnected(receive: Receive) -> None:
    """Return when the client has gone (uvicorn's `http.disconnect`), the request's body read or not."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def guarded(request: Request, work: Awaitable[T], timeout_s: float) -> T:
    """Await `work` unless the client disconnects first (ClientGone) or `timeout_s` passes (504); either way
    `work` is cancelled, which cancels its generation. `work` runs in the caller's task, so what it decides
    without waiting (a refusal on arrival) is answered in the same step of the event loop: run as a task of its
    own it waited for the loop to start it and then to wake the caller, 20-55 ms at p90-p99 of an open-loop image
    burst on a 2-core box, most of a refusal's time in the router. A watcher task cancels the caller's task
    when the client leaves."""
    caller = asyncio.current_task()
    assert caller is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request.receive)
        gone = True
        caller.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        async with asyncio.timeout(timeout_s):
            return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # the caller itself was cancelled
        caller.uncancel()
        raise ClientGone from None
    except TimeoutError:
        raise HttpError(
            504, "request did not finish within the router's request timeout", "deadline_exceeded"
        ) from None
    finally:
        watcher.cancel()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large_body(limit)
    pieces, size = [], 0
    async for piece in request.stream():  # joined once at the end: a bytearray grown piece by piece copied
        pieces.append(piece)  # a 10 MB body ~9 times over (20 ms here)
        size += len(piece)
        if size > limit:
            raise too_large_body(limit)
    return b"".join(pieces)


async def collect(stream: AsyncIterator[generation_pb2.GenerateResponse], builder: CompletionBuilder) -> None:
    async with contextlib.aclosing(stream):
        async for response in stream:
            builder.add(response)


async def events(
    first: generation_pb2.GenerateResponse,
    stream: AsyncIterator[generation_pb2.GenerateResponse],
    writer: ChunkWriter,
) -> AsyncIterator[bytes]:
    """The SSE body: the role chunk, a chunk per response, then `[DONE]`; a failure mid-stream is sent
    as an error event (the status line has gone already). The events of one response go out as one piece
    (the role chunk with the first response's, `[DONE]` with the last's): one socket write each."""
    async with contextlib.aclosing(stream):
        pending = sse_all(writer.start())  # goes out with the first response's events
        response: generation_pb2.GenerateResponse | None = first
        while response is not None:
            events, pending = pending + writer.encoded(response), b""
            if response.HasField("final"):
                pending = events  # goes out with [DONE]
            elif events:
                yield events
            try:
                response = await anext(stream, None)
            except RequestError as exc:
                pending += sse(from_request_error(exc).body())
                break
            except Exception:
                log.exception("HTTP stream failed unexpectedly")
                pending += sse(internal().body())
                break
        yield pending + DONE


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes, max_constraint_bytes: int | None = None) -> M:
    """`raw` as a `model` body; HttpError (400) naming the field at fault. A structured-output constraint
    surely over `max_constraint_bytes` is refused before the body is validated (`oversized_in_body`)."""
    try:
        oversized_in_body(raw, max_constraint_bytes)
        return model.model_validate_json(raw, context={MAX_CONSTRAINT_BYTES: max_constraint_bytes})
    except ConstraintTooLarge as exc:
        raise HttpError(400, str(exc), "invalid_argument", param=exc.field) from None
    except ValidationError as exc:
        try:  # pydantic's own parser: ~15x json's speed on a body of long strings (a 10 MB schema: 1.4 ms)
            sent = from_json(raw)
        except ValueError:  # a body nested past the parser's limit: pydantic said so
            sent = None
        raise from_validation(exc, sent) from exc
