"""Tool calls in Qwen's format: the tools rendered into the system turn, the grammar that makes one call of
them always parse (`tool_choice` required or a named function), and the calls parsed out of the text, whole
or as it streams.

Invariants: a call is `<tool_call>`, a JSON object with a string `name` and an object `arguments`, then
`</tool_call>`; text that does not parse as one stays content. The streamed parse finds the same calls as the
whole-text parse of the same text, and the same content but for the whitespace around the calls (which the
whole-text parse strips); it never lets a piece of an opening tag out as content before it knows.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.grammar import ConstraintError, check_schema_document, json_strings, library_message
from services.common.rpc.epd.v1 import generation_pb2

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_ROOT = re.compile(r"(?<![\w])root(?![\w])")


def tool_json(tool: generation_pb2.Tool) -> dict[str, Any]:
    """The tool as OpenAI's `{"type": "function", "function": {...}}`, as Qwen's template writes it."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
    return {"type": "function", "function": function}


def tools_system_text(tools: list[generation_pb2.Tool]) -> str:
    """The tools block Qwen2.5's chat template adds to the system turn (the model's own tool-call prompt)."""
    listed = "\n".join(json.dumps(tool_json(t), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def check_tools(tools: list[generation_pb2.Tool], choice: generation_pb2.ToolChoice, max_depth: int) -> None:
    """ConstraintError (its message names the field) for a malformed tool or tool choice."""
    if len(tools) > MAX_TOOLS:
        raise ConstraintError(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
    names = [t.name for t in tools]
    for i, tool in enumerate(tools):
        if not NAME.match(tool.name):
            raise ConstraintError(f"tools[{i}].name must be 1-64 letters, digits, '_' or '-', got {tool.name!r}")
        if tool.parameters:
            try:
                schema = json.loads(tool.parameters)
            except (ValueError, RecursionError):
                raise ConstraintError(f"tools[{i}].parameters is not a JSON document") from None
            check_schema_document(schema, max_depth, f"tools[{i}].parameters")
    if len(set(names)) < len(names):
        raise ConstraintError("tools: each name at most once")
    if choice.mode not in ("", "auto", "none", "required", "function"):
        raise ConstraintError(f"tool_choice must be auto, none, required or a function, got {choice.mode!r}")
    if choice.mode in ("required", "function") and not tools:
        raise ConstraintError(f"tool_choice {choice.mode} needs tools")
    if choice.mode == "function" and choice.function not in names:
        raise ConstraintError(f"tool_choice names {choice.function!r}, which is not among the tools")


def call_grammar(tools: list[generation_pb2.Tool], any_whitespace: bool) -> str:
    """An EBNF grammar (xgrammar's) of exactly one call of one of ``tools``: ``<tool_call>\\n``, a JSON object
    of its `name` and of `arguments` following its parameters' schema, ``\\n</tool_call>``."""
    import xgrammar as xgr

    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": tool_json(t)["function"]["parameters"]},
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        body = str(json_strings(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace)))
    except (RuntimeError, ValueError) as exc:
        raise ConstraintError(f"tools do not compile: {library_message(exc)}") from None
    renamed = _ROOT.sub("tool_call_json", body)
    return f'root ::= "{OPEN}\\n" tool_call_json "\\n{CLOSE}"\n{renamed}'


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str) -> generation_pb2.ToolCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return generation_pb2.ToolCall(id=call_id(), name=value["name"], arguments=text)


def parse_tool_calls(text: str) -> tuple[str, list[generation_pb2.ToolCall]]:
    """The content (the text less the calls that parse, stripped) and the calls, in order."""
    calls: list[generation_pb2.ToolCall] = []
    content: list[str] = []
    end = 0
    for match in _CALL.finditer(text):
        call = _call(match[1])
        if call is None:
            continue
        content.append(text[end : match.start()])
        calls.append(call)
        end = match.end()
    content.append(text[end:])
    return "".join(content).strip() if calls else text, calls


@dataclass
class ToolCallStream:
    """One streamed choice's text split into content and calls as it arrives (`feed`), then `finish`."""

    _held: str = ""  # text from an opening tag (or a piece of one) on, not yet given out

    def feed(self, text: str) -> tuple[str, list[generation_pb2.ToolCall]]:
        """The content now final and the calls now complete."""
        self._held += text
        content: list[str] = []
        calls: list[generation_pb2.ToolCall] = []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_tag(self._held)
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            content.append(self._held[:start])
            self._held = self._held[start:]
            close = self._held.find(CLOSE)
            if close < 0:
                break
            whole = self._held[: close + len(CLOSE)]
            call = _call(whole[len(OPEN) : close])
            if call is None:
                content.append(whole)
            else:
                calls.append(call)
            self._held = self._held[close + len(CLOSE) :]
        return "".join(content), calls

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def finish(self) -> str:
        """What is still held at the end (an unclosed call): content after all."""
        held, self._held = self._held, ""
        return held


def _partial_tag(text: str) -> int:
    """How many trailing characters of ``text`` could begin an opening tag."""
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return keep
    return 0
