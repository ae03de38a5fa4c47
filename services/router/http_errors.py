"""HTTP statuses and OpenAI error bodies for the router's failures (one table for the whole HTTP API).

Invariant: an error keeps the message gRPC clients get for the same request, in the HTTP API's field
names (`sampling.max_tokens ...` becomes `max_tokens ...`, or `max_completion_tokens ...` when the body
set that), with `param` the field or place at fault (`temperature`, `messages[0].content[1]`); only the
status is chosen here, from the gRPC status code (and, for bad input, whether it was about size in
bytes). A body that is not a valid request names its field the same way, never a validator's internals.
The body is OpenAI's `{"error": {"message", "type", "param", "code"}}` with `code` the gRPC status
name in lower case, so HTTP and gRPC clients can match on the same word.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from services.router.api_model import FieldError
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


SAMPLING_FIELD = re.compile(r"^sampling\.(\w+)")
PLACE = re.compile(r"^(messages\[\d+\](?:\.content\[\d+\])?|prompt|tokens\[\d+\])(?=:)")


def in_http_terms(message: str, names: Mapping[str, str]) -> tuple[str, str | None]:
    """A gRPC message in the HTTP API's field names (`names`: SamplingParams field -> HTTP field, where they
    differ) and the field or place it is about (None when it names none)."""
    field = SAMPLING_FIELD.match(message)
    if field is not None:
        name = names.get(field[1], field[1])
        return name + message[field.end() :], name
    place = PLACE.match(message)
    return message, place[1] if place else None


def from_request_error(exc: RequestError, names: Mapping[str, str] | None = None) -> HttpError:
    """The HTTP answer to a failure the gRPC API reports with `exc.code` and `exc.message`; with the
    request's `names` (see `in_http_terms`) the message names HTTP fields and `param` is set."""
    code = exc.code.name.lower()
    status = STATUS.get(exc.code, 500)
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT and _is_too_large(exc):
        status = 413
    message, param = exc.message, None
    if names is not None and exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        message, param = in_http_terms(message, names)
    if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
        message = f"{message}; {NEVER_FITS}"
    headers = _retry_after(exc) if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else {}
    return HttpError(status, message, code, param=param, headers=headers)


JSON_KINDS = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
}
EXPECTED = {
    "string_type": "a string",
    "list_type": "an array",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _kind(value: Any) -> str:
    return "null" if value is None else JSON_KINDS.get(type(value), type(value).__name__)


def _walk(loc: tuple[Any, ...], body: Any, missing: bool = False) -> tuple[str, Any]:
    """The path of `loc` in the body as sent (`messages[0].content[1].image_url.url`) and the value there:
    a union member's tag in `loc` (pydantic's `str`, `list[...]`, a discriminator's value) is not a key
    or index of the body, so it is left out; the last name stays when it is the `missing` field's."""
    path, value = "", body
    for position, part in enumerate(loc):
        if isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value):
            path, value = f"{path}[{part}]", value[part]
        elif (
            isinstance(part, str)
            and isinstance(value, dict)
            and (part in value or (missing and position == len(loc) - 1))
        ):
            path, value = f"{path}.{part}" if path else part, value.get(part)
    return path, value


def _said(error: dict[str, Any], value: Any) -> tuple[str, str]:
    """What is wrong, in words, and the suffix of `param` below the error's path."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in EXPECTED:
        return f"expected {EXPECTED[kind]}, got {_kind(value)}", ""
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        sign = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(v for k, v in ctx.items() if k in ("ge", "gt", "le", "lt")))
        return f"must be {sign} {bound}, got {value!r}", ""
    if kind == "finite_number":
        return "must be a finite number (NaN and infinity are refused)", ""
    if kind == "missing":
        return "required", ""
    if kind == "union_tag_invalid":  # a content part's `type`, a message's `role`
        field = ctx["discriminator"].strip("'")
        return f"{ctx['tag']!r} is not supported; use one of {ctx['expected_tags']}", f".{field}"
    if kind == "union_tag_not_found":
        return "required", f".{ctx['discriminator'].strip(chr(39))}"
    if kind == "string_too_short":
        return "must not be empty", ""
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item{'s' if ctx['min_length'] != 1 else ''}", ""
    if kind == "literal_error":
        return f"must be {ctx['expected']}, got {value!r}", ""
    if kind == "value_error":
        return str(ctx["error"]), ""
    return error["msg"], ""


def from_validation(exc: ValidationError, body: Any = None) -> HttpError:
    """A body that is not a valid request: 400 naming the field at fault in the body's own terms (`body` is
    the parsed JSON, to tell its keys from the validator's union tags). Of several errors (a union's
    members each report one) the deepest place wins; alternatives at one place are said together."""
    errors = exc.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        said = errors[0]["ctx"]["error"]
        if said.startswith("recursion limit exceeded"):  # valid JSON, past the parser's nesting limit
            return HttpError(400, f"the body is nested too deeply to read ({said})", "invalid_argument")
        return HttpError(400, f"the body is not valid JSON: {said}", "invalid_argument")
    placed = [(*_walk(tuple(e["loc"]), body, e["type"] == "missing"), e) for e in errors]
    deepest = max(len(path) for path, _, _ in placed)
    path, value, first = next(item for item in placed if len(item[0]) == deepest)
    refusal = (first.get("ctx") or {}).get("error")
    if isinstance(refusal, FieldError):  # its message starts with its field's name
        param = f"{path}.{refusal.field}" if path else refusal.field
        message = f"{path}.{refusal}" if path else str(refusal)
        return HttpError(400, message, "invalid_argument", param=param)
    alternatives = list(dict.fromkeys(EXPECTED[e["type"]] for p, _, e in placed if p == path and e["type"] in EXPECTED))
    if first["type"] in EXPECTED and len(alternatives) > 1:
        said, below = f"expected {' or '.join(alternatives)}, got {_kind(value)}", ""
    else:
        said, below = _said(first, value)
    param = (f"{path}{below}" if path else below.lstrip(".")) or None
    return HttpError(400, f"{param}: {said}" if param else said, "invalid_argument", param=param)


def too_large_body(limit: int) -> HttpError:
    return HttpError(413, f"request body is above this server's limit of {limit} bytes", "invalid_argument")


def internal() -> HttpError:
    return HttpError(500, "internal error; see the router's log", "internal")
