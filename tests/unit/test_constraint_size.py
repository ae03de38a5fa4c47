"""The structured-output size limit on HTTP bodies: the lower bound it measures with, the refusal before
validation for every constraint field, the model validator's check for a body the raw read misses, and the
TCP_NODELAY the HTTP API's listening socket passes on to its connections."""

from __future__ import annotations

import json
import random
import socket
from typing import Any

import pytest

from services.common.grammar import json_text_exceeds
from services.router.constraint_size import CONSTRAINT_PATHS, ConstraintTooLarge, oversized_in_body
from services.router.http_errors import HttpError
from services.router.http_exchange import parse
from services.router.http_server import listen_socket
from services.router.openai_request import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]
LIMIT = 1000


def compact_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def measured(value: Any) -> int:
    """The smallest limit ``json_text_exceeds`` does not call exceeded: its count of ``value``."""
    low, high = 0, 1 << 24
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if json_text_exceeds(value, middle) else (low, middle)
    return low


def random_json(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.random()
    if depth > 4 or pick < 0.3:
        return rng.choice([7, 12345, -2.5, True, False, None, "", "ab", 'é\n"', "x" * rng.randint(0, 20)])
    if pick < 0.65:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {"k" * rng.randint(0, 5) + str(i): random_json(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_json_text_exceeds_counts_a_lower_bound_of_the_compact_text() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        value = random_json(rng)
        assert measured(value) <= compact_size(value), value
    for exact in [{}, [], "x", None, {"a": "b"}, ["x", "y"], {"a": {"b": [1, 2]}}, [[], []], {"a": True, "b": [None]}]:
        assert measured(exact) == compact_size(exact)  # ASCII text, one-digit numbers: the count is the size


def test_json_text_exceeds_stops_at_the_limit() -> None:
    class Endless(list):
        """A list whose iteration never ends: only a count that stops at the limit returns."""

        def __iter__(self) -> Any:
            while True:
                yield "item"

    assert json_text_exceeds({"schema": Endless()}, LIMIT)
    assert json_text_exceeds("x" * (LIMIT - 1), LIMIT)  # its quotes make LIMIT + 1 bytes
    assert not json_text_exceeds("x" * (LIMIT - 2), LIMIT)


def body_with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": USER}
    inner = body
    for key in path[:-1]:
        inner = inner.setdefault(key, {"type": "json_schema"} if key == "response_format" else {})
    inner[path[-1]] = value
    if path[0] == "response_format":
        body["response_format"]["json_schema"]["name"] = "x"
    return body


def oversized(path: tuple[str, ...]) -> Any:
    if path[-1] in ("json", "schema", "guided_json"):
        return {"type": "object", "description": "x" * LIMIT}
    if path[-1] in ("choice", "guided_choice"):
        return ["x" * (LIMIT // 2)] * 3
    return "x" * (LIMIT + 1)


@pytest.mark.parametrize("path", CONSTRAINT_PATHS, ids=".".join)
def test_every_constraint_field_is_refused_before_validation(path: tuple[str, ...]) -> None:
    field = ".".join(path)
    raw = json.dumps(body_with(path, oversized(path))).encode()
    with pytest.raises(ConstraintTooLarge) as info:
        oversized_in_body(raw, LIMIT)
    assert info.value.field == field
    with pytest.raises(HttpError) as refused:
        parse(ChatCompletionRequest, raw, LIMIT)
    assert (refused.value.status, refused.value.param) == (400, field)
    assert refused.value.message == f"{field} is above this server's limit of {LIMIT} bytes (EPD_STRUCTURED_MAX_BYTES)"
    # the same constraint within the limit is read as a request
    small = {"type": "object"} if isinstance(oversized(path), dict) else (["a", "b"] if "choice" in field else "a+")
    assert parse(ChatCompletionRequest, json.dumps(body_with(path, small)).encode(), LIMIT).structured_field()


def test_a_body_the_raw_read_misses_meets_the_same_limit_in_validation() -> None:
    # a key written with an escape is not found in the raw bytes; the validator's own check refuses it
    raw = json.dumps({"messages": USER, "guided_json": {"description": "x" * LIMIT}}).replace("guided", "\\u0067uided")
    oversized_in_body(raw.encode(), LIMIT)  # not caught here
    with pytest.raises(HttpError) as refused:
        parse(ChatCompletionRequest, raw.encode(), LIMIT)
    assert refused.value.param == "guided_json" and f"limit of {LIMIT} bytes" in refused.value.message
    text = json.dumps({"prompt": "hi", "structured_outputs": {"regex": "x" * (LIMIT + 1)}}).encode()
    with pytest.raises(HttpError) as refused:
        parse(CompletionRequest, text, LIMIT)
    assert refused.value.param == "structured_outputs.regex"


def test_bodies_without_a_large_constraint_are_not_read_twice() -> None:
    large_text = json.dumps({"messages": [{"role": "user", "content": "y" * 10 * LIMIT}]}).encode()
    oversized_in_body(large_text, LIMIT)  # large, but names no constraint field
    oversized_in_body(b"not json " + b"x" * LIMIT + b'"guided_json"', LIMIT)  # left to validation's message
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = parse(ChatCompletionRequest, json.dumps({"messages": USER, "guided_json": schema}).encode(), LIMIT)
    assert json.loads(body.constraints()[0][2]) == schema  # the schema written out once, as sent


def test_the_http_listening_socket_names_tcp_so_connections_get_nodelay() -> None:
    sock = listen_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # asyncio's _set_nodelay sets TCP_NODELAY only then
    finally:
        sock.close()
