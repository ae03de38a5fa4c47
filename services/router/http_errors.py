"""HTTP statuses and OpenAI error bodies for the router's failures (one table for the whole HTTP API).

Invariant: an error keeps the message gRPC clients get for the same request; only the status is
chosen here, from the gRPC status code (and, for bad input, whether it was about size in bytes).
The body is OpenAI's `{"error": {"message", "type", "param", "code"}}` with `code` the gRPC status
name in lower case, so HTTP and gRPC clients can match on the same word.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from services.router.errors import RequestError
from services.router.fetch_policy import FetchError, FetchReason

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error", 499: "cancelled"}
NEVER_FITS = "it can never fit on any worker of this cluster: lower max_tokens or send a shorter prompt"


class HttpError(Exception):
    """An error answer: status, OpenAI body fields and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _is_too_large(exc: RequestError) -> bool:
    cause = exc.__cause__
    return exc.too_large or (isinstance(cause, FetchError) and cause.reason == FetchReason.TOO_LARGE)


def _retry_after(exc: RequestError) -> dict[str, str]:
    """`Retry-After` in whole seconds (at least 1) and OpenAI's `retry-after-ms`, from the admission's hint."""
    hint = dict(exc.metadata).get("retry-after-ms")
    if hint is None or not hint.isdigit():
        return {}
    return {"Retry-After": str(max(1, math.ceil(int(hint) / 1000))), "retry-after-ms": hint}


def from_request_error(exc: RequestError) -> HttpError:
    """The HTTP answer to a failure the gRPC API reports with `exc.code` and `exc.message`."""
    code = exc.code.name.lower()
    status = STATUS.get(exc.code, 500)
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT and _is_too_large(exc):
        status = 413
    message = exc.message
    if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
        message = f"{message}; {NEVER_FITS}"
    headers = _retry_after(exc) if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else {}
    return HttpError(status, message, code, headers=headers)


def from_validation(exc: ValidationError) -> HttpError:
    """A body that is not a valid request: 400 naming the first field at fault."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    said = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]  # no "Value error, "
    message = f"{param}: {said}" if param else said
    return HttpError(400, message, "invalid_argument", param=param)


def too_large_body(limit: int) -> HttpError:
    return HttpError(413, f"request body is above this server's limit of {limit} bytes", "invalid_argument")


def internal() -> HttpError:
    return HttpError(500, "internal error; see the router's log", "internal")
