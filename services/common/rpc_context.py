"""gRPC interceptors that carry the request id and the W3C trace context across every hop.

Client side (`client_interceptors`): each outgoing call gets `x-request-id` (the current request's id,
services/common/logs.py) and `traceparent` / `tracestate` (the current span's context) in its
metadata, when there are any; the call object is the channel's own (no wrapping), so `read()`,
`cancel()` and metadata work as without the interceptor.

Server side (`ServerContextInterceptor`): before a method's code runs, the incoming trace context
becomes current and the incoming `x-request-id` becomes the request id; with `echo=True` (the
router's public API) a client's `x-request-id` is sent back in the initial metadata. Each RPC runs
in its own task, so what is bound here never leaks into another call.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate

from services.common.logs import bind_request_id, current_request_id

REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 128


def clean_request_id(value: str) -> str:
    """A client's request id as accepted: printable ASCII without spaces, at most 128 characters; else ""."""
    value = value.strip()
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not all(33 <= ord(c) < 127 for c in value):
        return ""
    return value


def outgoing_metadata(metadata: Iterable[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """`metadata` plus the current request id and trace context (keys already present are kept)."""
    pairs = list(metadata or ())
    present = {key for key, _ in pairs}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    request_id = current_request_id()
    if request_id:
        carrier[REQUEST_ID_KEY] = request_id
    return pairs + [(key, value) for key, value in carrier.items() if key not in present]


def bind_incoming(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """Make the trace context and request id in `metadata` current; returns the request id bound ("" if none)."""
    carrier: Mapping[str, str] = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    if "traceparent" in carrier:
        otel_context.attach(propagate.extract(carrier))  # never detached: the RPC's task ends with the call
    request_id = clean_request_id(carrier.get(REQUEST_ID_KEY, ""))
    bind_request_id(request_id)
    return request_id


class _Outgoing:
    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            outgoing_metadata(details.metadata),
            details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnary(_Outgoing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_Outgoing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_Outgoing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_Outgoing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call shape, for `grpc.aio.*_channel(..., interceptors=...)`."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


class ServerContextInterceptor(grpc.aio.ServerInterceptor):
    """Binds the incoming trace context and request id around every method (see the module docstring)."""

    def __init__(self, echo: bool = False) -> None:
        self._echo = echo

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.response_streaming:
            behavior = handler.unary_stream or handler.stream_stream
            wrapped = self._streaming(behavior)
        else:
            behavior = handler.unary_unary or handler.stream_unary
            wrapped = self._unary(behavior)
        return handler._replace(
            **{
                name: wrapped
                for name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                if getattr(handler, name) is behavior
            }
        )

    async def _bind(self, context: grpc.aio.ServicerContext) -> None:
        request_id = bind_incoming(context.invocation_metadata())
        if self._echo and request_id:
            await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))

    def _unary(self, behavior: Callable) -> Callable:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._bind(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return run

    def _streaming(self, behavior: Callable) -> Callable:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await self._bind(context)
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for response in result:
                    yield response
            else:  # a handler that writes with context.write() and returns
                await result

        return run
