"""The size limit on an HTTP body's structured-output constraint, checked before the body is validated.

Invariant: a constraint (a schema, regex, grammar or choice list) surely longer than the router's
EPD_STRUCTURED_MAX_BYTES is refused as a `FieldError` naming its HTTP field and the limit without being
validated or written out as text: `oversized_in_body` reads a body that is larger than the limit and names
one of `CONSTRAINT_PATHS` with pydantic's JSON parser (~1 ms for 10 MB of strings), and measures each
constraint with `json_text_exceeds`, a lower bound that stops at the limit. So a 10 MB schema costs its upload
and one parse, never a validation or a `json.dumps`. A body it does not catch (a key written with escapes)
meets the same check in the request model's validator, and the router's `check_constraint` measures the
exact text of whatever passes, so the bound here only ever refuses early, never admits.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import from_json

from services.common.grammar import json_text_exceeds

CONSTRAINT_PATHS: tuple[tuple[str, ...], ...] = (
    ("response_format", "json_schema", "schema"),
    ("structured_outputs", "json"),
    ("structured_outputs", "regex"),
    ("structured_outputs", "choice"),
    ("structured_outputs", "grammar"),
    ("guided_json",),
    ("guided_regex",),
    ("guided_choice",),
    ("guided_grammar",),
)
"""Where a body carries a constraint's value (its HTTP field is the path joined with dots)."""
_TOP_KEYS = dict.fromkeys(path[0] for path in CONSTRAINT_PATHS)
_KEY = re.compile(f'"(?:{"|".join(map(re.escape, _TOP_KEYS))})"'.encode())
"""A constraint's top-level key, quoted: one search of a body (0.3 ms for an 800 KB image body, where a search per
key took 1.5)."""


class ConstraintTooLarge(ValueError):
    """A constraint over the limit: ``field`` is its HTTP field; the message starts with it."""

    def __init__(self, field: str, max_bytes: int) -> None:
        super().__init__(f"{field} is above this server's limit of {max_bytes} bytes (EPD_STRUCTURED_MAX_BYTES)")
        self.field = field


def check_constraint_size(field: str, value: Any, max_bytes: int | None) -> None:
    """ConstraintTooLarge when ``value`` (a schema as parsed, a text, a list of choices) is surely more than
    ``max_bytes`` of text, in O(min(size, max_bytes)); None: no check."""
    if max_bytes is None:
        return
    if len(value) > max_bytes if isinstance(value, str) else json_text_exceeds(value, max_bytes):
        raise ConstraintTooLarge(field, max_bytes)


def oversized_in_body(raw: bytes, max_bytes: int | None) -> None:
    """ConstraintTooLarge for the first constraint of the JSON body ``raw`` surely over ``max_bytes``. A body
    no longer than the limit, or naming no constraint field, is not parsed; one that is not JSON (or not an
    object) is left to the validation that follows."""
    if max_bytes is None or len(raw) <= max_bytes or _KEY.search(raw) is None:
        return
    try:
        sent = from_json(raw)
    except ValueError:
        return
    for path in CONSTRAINT_PATHS:
        value: Any = sent
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            check_constraint_size(".".join(path), value, max_bytes)
