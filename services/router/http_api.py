"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, count_tokens, tokenize, models, health.

Invariants: a chat or text completion runs through the router's one generation path (`generate_stream`,
the same admission, limits, safe fetch and metrics as gRPC's Generate) and is answered from the same
`GenerateResponse` stream; a body refused before it reaches that path is counted as an invalid request
all the same. Every `/v1` route and `/tokenize`, `/detokenize` authenticate first (the `Authorization:
Bearer` key names the tenant; a missing or wrong key is 401 before the body is read); `/health`,
`/version`, `/openapi.json` and `/docs` stay open. A client that disconnects, before or during the
answer, cancels the generation, which frees the request's KV blocks on its worker. No request waits past
the router's request timeout (504). Every error answer is OpenAI's error JSON in the HTTP API's own field
names (services/router/http_errors.py); a 405 names the allowed methods in `Allow`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from services.common.rpc.epd.v1 import generation_pb2
from services.common.rpc_context import bind_incoming
from services.router.errors import RequestError
from services.router.http_errors import (
    HttpError,
    from_request_error,
    internal,
)
from services.router.http_exchange import (
    ClientGone,
    EventStream,
    collect,
    events,
    guarded,
    parse,
    read_body,
)
from services.router.openai_request import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_request,
    generate_request,
)
from services.router.openai_response import (
    ChunkWriter,
    CompletionBuilder,
    Envelope,
    StreamUsage,
    TextChunkWriter,
    TextCompletionBuilder,
    token_count_json,
)
from services.router.openapi_doc import SUMMARIES, openapi_document
from services.router.tokens_api import DetokenizeRequest, TokenizeRequest, Tokens, tokenize_json

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
DEADLINE_GRACE_S = 1.0  # the worker call's own deadline (the same timeout) ends a request first, with its message
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never read by anyone


class Generation(Protocol):
    """The router's generation path (services/router/server.py's GenerationServicer)."""

    def authenticate(self, authorization: Iterable[str]) -> str: ...

    def generate_stream(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None, tenant: str
    ) -> AsyncIterator[generation_pb2.GenerateResponse]: ...

    async def count_tokens(self, request: generation_pb2.GenerateRequest) -> generation_pb2.TokenCount: ...


class Workers(Protocol):
    def workers(self) -> list[Any]: ...


@dataclass(frozen=True)
class HttpApi:
    """What the HTTP API serves from: shared objects of the router process, never copies."""

    generation: Generation
    view: Workers
    count_invalid: Callable[[], None]  # counts a request refused before it reached the generation path
    count_invalid_count: Callable[[], None]  # the same for count_tokens (CountTokens' own metric)
    tokens: Tokens
    model_id: str
    max_model_len: int
    request_timeout_s: float
    max_body_bytes: int
    max_constraint_bytes: int  # EPD_STRUCTURED_MAX_BYTES: a longer constraint is refused while the body is read
    version: str


def served_model_id(model_dir: Path) -> str:
    """The model's id on the API: the model folder's name (e.g. `Qwen2-VL-7B-Instruct`)."""
    return model_dir.resolve().name


class Routes:
    """The endpoints, over one HttpApi."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.created = int(time.time())

    def tenant(self, request: Request) -> str:
        """The caller's tenant; RequestError (401) for a missing or wrong key."""
        return self.api.generation.authenticate(request.headers.getlist("authorization"))

    async def body(self, request: Request, model: type[M]) -> M:
        body = parse(model, await read_body(request, self.api.max_body_bytes), self.api.max_constraint_bytes)
        name = getattr(body, "model", None)
        if name is not None and name != self.api.model_id:
            raise HttpError(
                404, f"model {name!r} is not served here; use {self.api.model_id!r}", "model_not_found", param="model"
            )
        return body

    async def _admitted(self, request: Request, model: type[M], count: Callable[[], None]) -> M:
        """The body, or the refusal (counted by `count`) of one that is not a valid request."""
        try:
            return await self.body(request, model)
        except (HttpError, RequestError):
            count()
            raise

    async def chat_completions(self, request: Request) -> Response:
        tenant = self.tenant(request)
        client_request_id = bind_incoming(request.headers.items())  # `traceparent`, `x-request-id` (kept if valid)
        body = await self._admitted(request, ChatCompletionRequest, self.api.count_invalid)
        proto = generate_request(body, client_request_id or uuid.uuid4().hex)
        envelope = Envelope(f"chatcmpl-{proto.request_id}", int(time.time()), self.api.model_id)
        logprobs = bool(body.logprobs)
        if body.stream:
            usage = StreamUsage(body.include_usage, body.continuous_usage)
            writer = ChunkWriter(envelope, body.choices, usage, logprobs, tools=body.offers_tools)
            return await self._stream(request, tenant, proto, body.field_names(), writer)
        builder = CompletionBuilder(envelope, logprobs)
        return await self._whole(request, tenant, proto, body.field_names(), builder)

    async def completions(self, request: Request) -> Response:
        tenant = self.tenant(request)
        client_request_id = bind_incoming(request.headers.items())
        body = await self._admitted(request, CompletionRequest, self.api.count_invalid)
        proto = completion_request(body, client_request_id or uuid.uuid4().hex)
        envelope = Envelope(f"cmpl-{proto.request_id}", int(time.time()), self.api.model_id)
        logprobs = body.logprobs is not None
        if body.stream:
            writer = TextChunkWriter(envelope, StreamUsage(body.include_usage, body.continuous_usage), logprobs)
            return await self._stream(request, tenant, proto, body.field_names(), writer)
        builder = TextCompletionBuilder(envelope, logprobs)
        return await self._whole(request, tenant, proto, body.field_names(), builder)

    async def _stream(
        self,
        request: Request,
        tenant: str,
        proto: generation_pb2.GenerateRequest,
        names: dict[str, str],
        writer: ChunkWriter | TextChunkWriter,
    ) -> Response:
        stream = self.api.generation.generate_stream(proto, None, tenant)
        try:
            first = await guarded(request, anext(stream, None), self.api.request_timeout_s + DEADLINE_GRACE_S)
        except RequestError as exc:
            raise from_request_error(exc, names) from exc
        if first is None:
            raise internal()
        headers = {"X-Request-Id": proto.request_id, "Cache-Control": "no-cache"}
        return EventStream(events(first, stream, writer), headers=headers)

    async def _whole(
        self,
        request: Request,
        tenant: str,
        proto: generation_pb2.GenerateRequest,
        names: dict[str, str],
        builder: CompletionBuilder | TextCompletionBuilder,
    ) -> Response:
        stream = self.api.generation.generate_stream(proto, None, tenant)
        try:
            await guarded(request, collect(stream, builder), self.api.request_timeout_s + DEADLINE_GRACE_S)
        except RequestError as exc:
            raise from_request_error(exc, names) from exc
        return JSONResponse(builder.result(), headers={"X-Request-Id": proto.request_id})

    async def count_tokens(self, request: Request) -> dict[str, Any]:
        self.tenant(request)
        bind_incoming(request.headers.items())
        body = await self._admitted(request, ChatCompletionRequest, self.api.count_invalid_count)
        try:
            count = await guarded(
                request, self.api.generation.count_tokens(generate_request(body, "")), self.api.request_timeout_s
            )
        except RequestError as exc:
            raise from_request_error(exc, body.field_names()) from exc
        return token_count_json(count)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        self.tenant(request)
        body = await self.body(request, TokenizeRequest)
        try:
            ids = await guarded(request, self.api.tokens.tokenize(body), self.api.request_timeout_s)
        except RequestError as exc:
            raise from_request_error(exc, {}) from exc
        strs = self.api.tokens.token_strs(ids) if body.return_token_strs else None
        return tokenize_json(ids, self.api.max_model_len, strs)

    async def detokenize(self, request: Request) -> dict[str, Any]:
        self.tenant(request)
        body = await self.body(request, DetokenizeRequest)
        try:
            text = await self.api.tokens.detokenize(body.tokens)
        except RequestError as exc:
            raise from_request_error(exc, {}) from exc
        return {"prompt": text}

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.api.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "epd",
            "max_model_len": self.api.max_model_len,
        }

    async def models(self, request: Request) -> dict[str, Any]:
        self.tenant(request)
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        self.tenant(request)
        if model_id != self.api.model_id:
            raise HttpError(404, f"model {model_id!r} is not served here", "model_not_found", param="model")
        return self.model_card()

    async def health(self) -> dict[str, Any]:
        workers = len(self.api.view.workers())
        if not workers:
            raise HttpError(503, "no worker is registered: this router cannot serve requests now", "unavailable")
        return {"status": "ok", "workers": workers}

    async def version(self) -> dict[str, Any]:
        return {"version": self.api.version}


def _install_error_handlers(app: FastAPI) -> None:
    async def on_http_error(_: Request, exc: HttpError) -> Response:
        return exc.response()

    async def on_request_error(_: Request, exc: RequestError) -> Response:
        return from_request_error(exc).response()

    async def on_client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    async def on_starlette(_: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_argument")
        return HttpError(exc.status_code, str(exc.detail), code, headers=dict(exc.headers or {})).response()  # Allow

    async def on_unexpected(_: Request, __: Exception) -> Response:
        return internal().response()  # Starlette re-raises it afterwards, and uvicorn logs it

    app.add_exception_handler(HttpError, on_http_error)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(HTTPException, on_starlette)
    app.add_exception_handler(Exception, on_unexpected)


def build_app(api: HttpApi) -> FastAPI:
    """The ASGI app; it holds no state of its own beyond `api` (and its OpenAPI document, built once)."""
    app = FastAPI(
        title="epd",
        version=api.version,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        # the router's own spans, metrics and finished lines cover every request (docs/observability.md); FastAPI's
        # native telemetry would add an HTTP span and instruments of its own once a tracer is set, and asks the
        # environment on every request whether one is (~2 % of the router's loop in an image burst)
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    routes = Routes(api)
    post = {
        "/v1/chat/completions": routes.chat_completions,
        "/v1/completions": routes.completions,
        "/v1/count_tokens": routes.count_tokens,
        "/tokenize": routes.tokenize,
        "/detokenize": routes.detokenize,
    }
    for path, endpoint in post.items():
        app.add_api_route(path, endpoint, methods=["POST"], summary=SUMMARIES[path])
    app.add_api_route("/v1/models", routes.models, methods=["GET"], summary=SUMMARIES["/v1/models"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"], summary="the served model")
    app.add_api_route("/health", routes.health, methods=["GET"], summary=SUMMARIES["/health"])
    app.add_api_route("/version", routes.version, methods=["GET"], summary=SUMMARIES["/version"])
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    _install_error_handlers(app)
    return app
