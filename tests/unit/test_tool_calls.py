"""Tool calls in Qwen's format without a cluster: the system turn's tools block, the grammar of one call (every
text it allows parses into a call of a named tool whose arguments follow that tool's schema), and the calls
parsed from a whole text and from the same text streamed in pieces of any size."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common.grammar import ConstraintError
from services.common.grammar_cache import tokenizer_info
from services.common.rpc.epd.v1 import generation_pb2
from services.router.tool_calls import (
    ToolCallStream,
    call_grammar,
    check_tools,
    parse_tool_calls,
    tools_system_text,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [
    generation_pb2.Tool(name="get_weather", description="The weather in a city", parameters=json.dumps(WEATHER)),
    generation_pb2.Tool(name="now"),
]
TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    "<tool_call>not json</tool_call> and <tool_call>\n"
    '{"name": "now", "arguments": {}}\n</tool_call><tool'
)


def test_the_tools_block_lists_each_tool_as_openai_writes_it() -> None:
    text = tools_system_text(TOOLS)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
        },
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
    ]
    assert text.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_bad_tools_and_choices_are_refused() -> None:
    auto = generation_pb2.ToolChoice(mode="auto")
    for tools, choice, said in [
        ([generation_pb2.Tool(name="a b")], auto, r"tools\[0\].name must be"),
        ([generation_pb2.Tool(name="a"), generation_pb2.Tool(name="a")], auto, "each name at most once"),
        ([generation_pb2.Tool(name="a", parameters="{")], auto, r"tools\[0\].parameters is not a JSON document"),
        ([generation_pb2.Tool(name="a", parameters='{"format": "credit-card"}')], auto, "format 'credit-card'"),
        ([], generation_pb2.ToolChoice(mode="required"), "tool_choice required needs tools"),
        (TOOLS, generation_pb2.ToolChoice(mode="function", function="other"), "'other', which is not among"),
        (TOOLS, generation_pb2.ToolChoice(mode="sometimes"), "tool_choice must be"),
    ]:
        with pytest.raises(ConstraintError, match=said):
            check_tools(tools, choice, 64)
    check_tools(TOOLS, generation_pb2.ToolChoice(mode="function", function="now"), 64)


def test_whole_and_streamed_parses_agree() -> None:
    content, calls = parse_tool_calls(TEXT)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert content == "Let me check. \n<tool_call>not json</tool_call> and <tool"
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert parse_tool_calls("no calls here ") == ("no calls here ", [])
    for size in (1, 2, 5, 13, len(TEXT)):
        stream, said, made = ToolCallStream(), [], []
        for start in range(0, len(TEXT), size):
            text, calls = stream.feed(TEXT[start : start + size])
            assert "<tool_" not in text or "not json" in "".join(said) + text
            said.append(text)
            made += calls
        said.append(stream.finish())
        assert [(c.name, c.arguments) for c in made] == [(c.name, c.arguments) for c in parse_tool_calls(TEXT)[1]]
        assert "".join(said).replace(" \n", " ").strip() == content.replace(" \n", " ")


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> xgr.GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return xgr.GrammarCompiler(tokenizer_info(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))


def test_the_call_grammar_accepts_exactly_one_call_of_a_tool(compiler: xgr.GrammarCompiler) -> None:
    grammar = compiler.compile_grammar(xgr.Grammar.from_ebnf(call_grammar(TOOLS, any_whitespace=False)))
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for text, accepted in [
        (good, True),
        ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
        ('<tool_call>\n{"name": "later", "arguments": {}}\n</tool_call>', False),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>', False),
        (good + "\n" + good, False),
        ("I will not call anything", False),
    ]:
        matcher = xgr.GrammarMatcher(grammar)
        assert (matcher.accept_string(text) and matcher.is_completed()) == accepted, text
    content, calls = parse_tool_calls(good)
    assert content == "" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    named = compiler.compile_grammar(xgr.Grammar.from_ebnf(call_grammar(TOOLS[1:], any_whitespace=False)))
    assert not xgr.GrammarMatcher(named).accept_string(good)
