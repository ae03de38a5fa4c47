"""Structured-output constraints (`SamplingParams.structured`: a JSON schema, any JSON object, a regex, a choice,
an EBNF grammar) read, checked against limits and turned into xgrammar grammars, for the router and the worker.

Invariants: `constraint_of` is the one reading of the proto's oneof, and `Constraint.key` (a sha256 of kind,
whitespace mode and text) is what both caches key on. `check_constraint` refuses, as `ConstraintError` naming
the problem, what the grammar library would not enforce or what could stall a step: a constraint over
`max_bytes`, a JSON schema nested deeper than `max_depth` (counted without recursion, so a 10,000-deep
document is refused, not a crash), a keyword or string `format` xgrammar would silently ignore (an output
would then not validate), a regex (also a schema's `pattern`) that nests unbounded repetition inside
unbounded repetition (its matcher's state grows with every token: `(x*x*)*y` stalls a step for minutes).
JSON is compact unless `any_whitespace`; schemas compile in xgrammar's strict mode (properties and items a
schema does not describe are never generated), as vLLM's default.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from services.common.rpc.epd.v1 import common_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
IGNORED_KEYWORDS = ("maxProperties", "propertyNames", "dependentRequired", "dependentSchemas")
"""JSON Schema keywords xgrammar 0.2 accepts but does not enforce: refused rather than ignored."""
_NAMED = ("properties", "$defs", "definitions", "patternProperties")
_VALUES = ("enum", "const", "default", "examples")  # keywords holding JSON values, not schemas: not walked
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /project/cpp/x.cc:12: " prefix


class ConstraintError(ValueError):
    """A constraint refused: the message names the problem (the router answers INVALID_ARGUMENT with it)."""


@dataclass(frozen=True)
class GrammarLimits:
    """What a constraint may be: at most ``max_bytes`` of text (UTF-8) and ``max_depth`` levels of
    nesting (a schema's JSON containers, a regex's groups)."""

    max_bytes: int = 128 << 10
    max_depth: int = 64


@dataclass(frozen=True)
class Constraint:
    """One request's constraint. ``text``: the schema's JSON, the regex, the grammar, or the choices as a JSON
    list; empty for ``json_object``."""

    kind: str
    text: str = ""
    any_whitespace: bool = False

    @property
    def key(self) -> str:
        data = f"{self.kind}\0{int(self.any_whitespace)}\0{self.text}".encode()
        return hashlib.sha256(data).hexdigest()

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


def constraint_of(sampling: common_pb2.SamplingParams, any_whitespace: bool = False) -> Constraint | None:
    """The request's constraint, or None for free text; ``any_whitespace`` when ``sampling`` leaves it unset."""
    kind = sampling.WhichOneof("structured")
    if kind is None:
        return None
    spaced = sampling.any_whitespace if sampling.HasField("any_whitespace") else any_whitespace
    if kind == "json_object":
        if not sampling.json_object:
            return None  # false: the field's off value
        return Constraint(kind, "", spaced)
    if kind == "choice":
        return Constraint(kind, json.dumps(list(sampling.choice.choices), ensure_ascii=False))
    text = getattr(sampling, kind)
    return Constraint(kind, text, spaced if kind == "json_schema" else False)


def json_text_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` (parsed JSON) written as JSON text is surely more than ``limit`` bytes. Counts a lower
    bound of its compact UTF-8 text (a string its characters and quotes, a number one byte, brackets, colons
    and commas) and stops as soon as the count passes ``limit``, so it costs O(min(size, limit)) whatever the
    value's size: a 10 MB schema is refused without being written out."""
    size = -1  # the top level's item has no comma before it
    stack: list[Any] = [iter((value,))]
    while stack:
        item = next(stack[-1], stack)  # the stack itself: the end of a container
        if item is stack:
            stack.pop()
            continue
        size += 1  # the comma before every item but a container's first (one per container taken back below)
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict | list):
            size += 2 - bool(item)  # its brackets, less its first item's comma
            stack.append(iter(item.items() if isinstance(item, dict) else item))
        elif isinstance(item, tuple):  # a dict's (key, value): the key, its quotes and colon
            size += len(item[0]) + 3 - 1  # less the comma the value's count adds: none stands before it
            stack.append(iter((item[1],)))
        else:
            size += 4 if item is None or isinstance(item, bool) else 1
        if size > limit:
            return True
    return False


def check_constraint(constraint: Constraint, limits: GrammarLimits) -> None:
    """ConstraintError for a constraint past ``limits`` or one the grammar would not enforce as written."""
    size = len(constraint.text.encode())
    if size > limits.max_bytes:
        raise ConstraintError(f"{_name(constraint)} is {size} bytes, above this server's limit of {limits.max_bytes}")
    if constraint.kind == "json_schema":
        _check_schema(constraint.text, limits)
    elif constraint.kind == "regex":
        check_regex(constraint.text, limits.max_depth, "regex")
    elif constraint.kind == "choice":
        choices = json.loads(constraint.text)
        if not choices or any(not c for c in choices):
            raise ConstraintError("choice needs at least one choice, each a non-empty string")
    elif constraint.kind == "grammar" and not constraint.text.strip():
        raise ConstraintError("grammar is empty")


def grammar_of(constraint: Constraint) -> Any:
    """The constraint as an ``xgrammar.Grammar`` (checked first with ``check_constraint``); ConstraintError with
    the library's message (its source location dropped) when it refuses it."""
    import xgrammar as xgr

    try:
        if constraint.kind == "json_schema":
            spaced = constraint.any_whitespace
            return json_strings(xgr.Grammar.from_json_schema(constraint.text, any_whitespace=spaced))
        if constraint.kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=constraint.any_whitespace, strict_mode=False
            )
        if constraint.kind == "regex":
            return xgr.Grammar.from_regex(constraint.text)
        if constraint.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(constraint.text)))
        return xgr.Grammar.from_ebnf(constraint.text)
    except (RuntimeError, ValueError) as exc:
        raise ConstraintError(f"{_name(constraint)} does not compile: {library_message(exc)}") from None


_LENGTH_BOUNDED_CHAR = r"[^\"\\\r\n]"  # xgrammar 0.2.8's character of a string with minLength/maxLength
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped: no control character


def json_strings(grammar: Any) -> Any:
    """``grammar`` with xgrammar 0.2.8's length-bounded string characters (which admit control characters,
    making output no JSON parser takes) narrowed to JSON's unescaped characters; the same grammar otherwise."""
    import xgrammar as xgr

    text = str(grammar)
    if _LENGTH_BOUNDED_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))


def choice_ebnf(choices: list[str]) -> str:
    """A grammar accepting exactly one of ``choices`` (JSON string literals are xgrammar's EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def library_message(exc: BaseException) -> str:
    """xgrammar's error text without its timestamp and C++ source location, on one line."""
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


def _name(constraint: Constraint) -> str:
    return {"json_schema": "json_schema", "json_object": "json_object"}.get(constraint.kind, constraint.kind)


def _check_schema(text: str, limits: GrammarLimits) -> None:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise ConstraintError(f"json_schema is nested deeper than this server's limit of {limits.max_depth}") from None
    except ValueError as exc:
        raise ConstraintError(f"json_schema is not valid JSON: {exc}") from None
    check_schema_document(schema, limits.max_depth)


def check_schema_document(schema: Any, max_depth: int, field: str = "json_schema") -> None:
    """ConstraintError when the parsed ``schema`` nests deeper than ``max_depth`` containers, is not an object
    (or boolean), uses a keyword xgrammar ignores (``IGNORED_KEYWORDS``), a ``format`` it does not enforce, or
    a ``pattern`` ``check_regex`` refuses. Walks with an explicit stack: no recursion limit to hit."""
    if not isinstance(schema, dict | bool):
        raise ConstraintError(f"{field} must be a JSON object (or a boolean), got {type(schema).__name__}")
    stack: list[tuple[Any, int, str]] = [(schema, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise ConstraintError(f"{field} is nested deeper than this server's limit of {max_depth}")
        if isinstance(node, list):
            stack.extend((item, depth + 1, f"{path}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        _check_keywords(node, path, field, max_depth)
        stack.extend((value, depth + 1, f"{path}/{key}") for key, value in node.items() if key not in _VALUES)


def _check_keywords(node: dict, path: str, field: str, max_depth: int) -> None:
    if path.rsplit("/", 1)[-1] in _NAMED:
        return  # a map of names to schemas: its keys are not keywords
    where = path or "/"
    for keyword in IGNORED_KEYWORDS:
        if keyword in node:
            raise ConstraintError(f"{field} at {where}: {keyword} is not supported by the grammar library")
    fmt = node.get("format")
    if isinstance(fmt, str) and not format_enforced(fmt):
        raise ConstraintError(f"{field} at {where}: format {fmt!r} is not supported (unknown to the grammar library)")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, max_depth, f"{field} at {where}: pattern")
    for key in node.get("patternProperties") or {}:
        check_regex(key, max_depth, f"{field} at {where}: patternProperties key")


@cache
def format_enforced(fmt: str) -> bool:
    """True when xgrammar constrains strings of this ``format`` (its grammar differs from that of a format no
    library knows): asked of the installed library, once per name."""
    import xgrammar as xgr

    def grammar(schema: dict) -> str:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema)))

    return grammar({"type": "string", "format": fmt}) != grammar({"type": "string", "format": "x-epd-unknown"})


_QUANTIFIER = re.compile(r"\*|\+|\?|\{(\d*)(,(\d*))?\}")


def _repeats(match: re.Match) -> tuple[int, bool, bool]:
    """(the fewest times, repeats more than once, without bound) for a quantifier ``_QUANTIFIER`` matched."""
    text = match[0]
    if text in ("*", "+"):
        return (0 if text == "*" else 1), True, True
    if text == "?":
        return 0, False, False
    low = int(match[1] or 0)
    if match[2] is None:  # {n}
        return low, low > 1, False
    if not match[3]:  # {n,}
        return low, True, True
    return low, int(match[3]) > 1, False


@dataclass
class _Group:
    """What the scanner knows of an open group: it holds an unbounded repetition; its current branch can match
    nothing so far; some earlier branch can."""

    unbounded: bool = False
    branch_empty: bool = True
    empty: bool = False


def check_regex(pattern: str, max_depth: int, field: str = "regex") -> None:
    """ConstraintError when ``pattern`` nests groups deeper than ``max_depth``, stacks two repetitions
    (``a*{2,}``, ``a**``), or repeats a group that holds an unbounded repetition or can match nothing
    (``(a+b)*``, ``(a*){50}``, ``(a?)+``): xgrammar's matcher then carries a state that grows with every token
    and steps stall (``(x*x*)*y`` for minutes, ``(a?)+b`` seconds per step after some hundred tokens,
    ``a*{2,}`` never ends). A lazy ``?`` after a repetition and an optional group (``(a*)?``) are fine.
    Escapes and character classes are single atoms; xgrammar checks the rest."""
    groups = [_Group()]  # the whole pattern is the outermost group
    i, n = 0, len(pattern)
    while i < n:
        ch, closed = pattern[i], None
        if ch == "(":
            groups.append(_Group())
            if len(groups) > max_depth + 1:
                raise ConstraintError(f"{field} nests groups deeper than this server's limit of {max_depth}")
            i += 3 if pattern.startswith("(?:", i) else 1
            continue
        if ch == "|":
            groups[-1].empty |= groups[-1].branch_empty
            groups[-1].branch_empty = True
            i += 1
            continue
        if ch == ")" and len(groups) > 1:
            closed = groups.pop()
            closed.empty |= closed.branch_empty
            i += 1
        elif ch == "\\":
            i += 2
        elif ch == "[":
            i = _class_end(pattern, i)
        else:
            i += 1
        zero_width = ch in "^$"
        match = _QUANTIFIER.match(pattern, i)
        fewest, repeats, unbounded = _repeats(match) if match else (1, False, False)
        hazardous = closed is not None and (closed.unbounded or closed.empty)
        if match is not None:
            if hazardous and repeats:
                raise ConstraintError(
                    f"{field} repeats a group that repeats without bound or can match nothing (as in (a+b)* or "
                    "(a?)+): its matching cost grows with every token; write the repetition once"
                )
            i = match.end()
            if i < n and pattern[i] == "?" and match[0] != "?":
                i += 1  # lazy: the same language
            if _QUANTIFIER.match(pattern, i):
                raise ConstraintError(f"{field} stacks two repetitions at {i} (as in a*{{2,}}); write one")
        group = groups[-1]
        group.unbounded |= unbounded or bool(closed and closed.unbounded)
        if not (zero_width or fewest == 0 or (closed is not None and closed.empty)):
            group.branch_empty = False


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opened at ``start`` (``]`` first in the class is a literal)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
