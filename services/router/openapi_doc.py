"""The HTTP API's OpenAPI document (`/openapi.json`, rendered at `/docs`), from the request models themselves.

Invariant: each POST route's request body schema is the JSON schema of the pydantic model its handler
parses (services/router/openai_request.py, tokens_api.py), so the document cannot drift from what is
accepted; every status a route answers with is listed, errors with OpenAI's error object. Built once per
app, on first request.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.router.openai_request import ChatCompletionRequest, CompletionRequest
from services.router.tokens_api import DetokenizeRequest, TokenizeRequest

SUMMARIES = {
    "/v1/chat/completions": "a chat completion (server-sent chunks with stream=true)",
    "/v1/completions": "a text completion of one prompt, no chat template (server-sent chunks with stream=true)",
    "/v1/count_tokens": "what a chat completion body would cost, in tokens; nothing generated",
    "/tokenize": "the token ids of a prompt, or of chat messages as the chat template renders them",
    "/detokenize": "the text of token ids",
    "/v1/models": "the one served model",
    "/health": "200 while a worker is registered, else 503",
    "/version": "epd's version",
}
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/count_tokens": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
ERRORS = {
    400: "bad input, an unsupported field, a value out of range, or a request that can never fit",
    401: "a missing or unknown API key (with EPD_API_KEYS_FILE)",
    404: "a model other than the served one",
    413: "a body, item or request's media over its byte limit",
    429: "overload: retry after Retry-After seconds",
    503: "no worker (or encoder) can serve the request",
    504: "the request did not finish within the router's request timeout",
}
ROUTE_ERRORS = {
    "/v1/chat/completions": (400, 401, 404, 413, 429, 503, 504),
    "/v1/completions": (400, 401, 404, 413, 429, 503, 504),
    "/v1/count_tokens": (400, 401, 404, 413, 503, 504),
    "/tokenize": (400, 401, 404, 413, 504),
    "/detokenize": (400, 401, 404, 413),
    "/v1/models": (401,),
    "/v1/models/{model_id}": (401, 404),
    "/health": (503,),
    "/version": (),
}
STREAMED = ("/v1/chat/completions", "/v1/completions")
OPEN = ("/health", "/version")
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string", "description": "the gRPC status name in lower case"},
            },
        }
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _responses(path: str) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if path in STREAMED:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[str, Any] = {"200": {"description": "the answer", "content": ok}}
    for status in ROUTE_ERRORS[path]:
        out[str(status)] = {"description": ERRORS[status], "content": {"application/json": {"schema": _ref("Error")}}}
    return out


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI 3.1 document (cached on the app after the first call)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(
        title="epd",
        version=app.version,
        description="OpenAI-compatible HTTP API of an epd router (docs/api.md)",
        routes=app.routes,
    )
    _, schemas = models_json_schema(
        [(model, "validation") for model in dict.fromkeys(BODIES.values())],
        ref_template="#/components/schemas/{model}",
    )
    components = doc.setdefault("components", {})
    components["schemas"] = {**schemas["$defs"], "Error": ERROR_SCHEMA}
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc["paths"].items():
        for operation in item.values():
            operation["responses"] = _responses(path)
            if path not in OPEN:
                operation["security"] = [{"bearer": []}, {}]  # needed only where the router has API keys
            if path in BODIES:
                schema = _ref(BODIES[path].__name__)
                operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    app.openapi_schema = doc
    return doc
