"""HTTP request bodies without a cluster: bounds, `null`, NaN, refused fields, errors in the API's own field
names, the gRPC messages renamed, the text completion objects and the OpenAPI document the app serves."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.router.errors import RequestError, invalid
from services.router.http_api import HttpApi, build_app
from services.router.http_errors import HttpError, from_request_error
from services.router.http_exchange import parse
from services.router.openai_request import (
    REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
    completion_request,
    generate_request,
)
from services.router.openai_response import (
    ChunkWriter,
    Envelope,
    StreamUsage,
    TextChunkWriter,
    TextCompletionBuilder,
    sse_all,
)

USER = [{"role": "user", "content": "hi"}]


def refusal(body: Any, model: type = ChatCompletionRequest) -> tuple[str | None, str]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(HttpError) as info:
        parse(model, raw)
    assert info.value.status == 400 and info.value.code == "invalid_argument"
    return info.value.param, info.value.message


@pytest.mark.parametrize("field", ["n", "max_tokens", "max_completion_tokens", "top_k"])
def test_uint32_fields_are_bounded_by_the_proto(field: str) -> None:
    assert refusal({"messages": USER, field: 1 << 32}) == (field, f"{field}: must be <= 4294967295, got 4294967296")
    proto = generate_request(parse(ChatCompletionRequest, json.dumps({"messages": USER, field: (1 << 32) - 1})), "r")
    assert proto.ByteSize() > 0  # the largest value the proto carries builds


def test_other_bounds() -> None:
    assert refusal({"messages": USER, "seed": 1 << 64})[0] == "seed"
    assert refusal({"messages": USER, "seed": -1}) == ("seed", "seed: must be >= 0, got -1")
    assert refusal({"messages": USER, "logprobs": True, "top_logprobs": 21})[0] == "top_logprobs"
    assert refusal({"prompt": "x", "logprobs": 21}, CompletionRequest) == (
        "logprobs",
        "logprobs: must be <= 20, got 21",
    )


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b'"nan"', b"1e39"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_nan_and_infinity_are_refused(field: str, value: bytes) -> None:
    param, message = refusal(
        b'{"messages": [{"role": "user", "content": "hi"}], "' + field.encode() + b'": ' + value + b"}"
    )
    assert param == field and message.startswith(f"{field}: must be")


def test_null_is_not_set() -> None:
    nullable = ["n", "stream", "logprobs", "top_logprobs", "temperature", "top_p", "stop", "seed", "max_tokens",
                "max_completion_tokens", "stream_options", "top_k", "ignore_eos", "cache_salt", "best_of",
                *[name for name, neutral in REFUSED.items() if None in neutral]]  # fmt: skip
    body = {"messages": [*USER, {"role": "assistant", "content": None}], **dict.fromkeys(nullable)}
    proto = generate_request(parse(ChatCompletionRequest, json.dumps(body).encode()), "r")
    plain = generate_request(parse(ChatCompletionRequest, json.dumps({"messages": body["messages"]}).encode()), "r")
    assert proto == plain
    assert proto.sampling == common_pb2.SamplingParams(temperature=1.0, top_p=1.0, n=1)
    assert proto.messages[1] == generation_pb2.Message(role="assistant", content=[generation_pb2.ContentPart(text="")])
    assert refusal({"messages": [{"role": "user", "content": None}]}) == (
        "messages[0].content",
        "messages[0].content: expected a string or an array, got null",
    )


def test_every_refused_field_names_itself_and_its_neutral_value_passes() -> None:
    for name, neutral in REFUSED.items():
        param, message = refusal({"messages": USER, name: "on"})
        assert param == name and message.startswith(f"{name} is not supported by this server yet")
        for value in neutral:
            parse(ChatCompletionRequest, json.dumps({"messages": USER, name: value}).encode())
    assert refusal({"messages": USER, "best_of": 2})[0] == "best_of"
    assert refusal({"messages": USER, "add_special_tokens": True})[0] == "add_special_tokens"
    assert refusal({"prompt": "x", "add_special_tokens": False}, CompletionRequest)[0] == "add_special_tokens"


def test_errors_name_the_field_as_the_body_sent_it() -> None:
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]
    assert refusal({"messages": audio}) == (
        "messages[0].content[0].type",
        "messages[0].content[0].type: 'input_audio' is not supported; use one of 'text', 'image_url', 'video_url'",
    )
    no_url = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]
    assert refusal({"messages": no_url}) == (
        "messages[0].content[1].image_url.url",
        "messages[0].content[1].image_url.url: required",
    )
    assert refusal({"messages": [{"role": "function", "content": "x"}]})[0] == "messages[0].role"
    assert refusal({"messages": USER, "stop": 5}) == ("stop", "stop: expected a string or an array, got an integer")
    assert refusal({"messages": "hello"}) == ("messages", "messages: expected an array, got a string")
    assert refusal({"messages": []}) == ("messages", "messages: must have at least 1 item")
    calls = [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]
    assert refusal({"messages": calls}) == (
        "messages[0].tool_calls[0].function",
        "messages[0].tool_calls[0].function: required",
    )
    streamed = {"stream": True, "stream_options": {"continuous_usage_stats": "often"}}
    assert refusal({"messages": USER, **streamed})[0] == "stream_options.continuous_usage_stats"
    assert refusal(b"{not json") == (None, "the body is not valid JSON: key must be a string at line 1 column 2")
    assert refusal({"prompt": [1, 2]}, CompletionRequest)[0] == "prompt"
    assert refusal({"prompt": ""}, CompletionRequest) == ("prompt", "prompt: must not be empty")


def test_router_messages_in_http_field_names() -> None:
    body = parse(ChatCompletionRequest, json.dumps({"messages": USER, "max_completion_tokens": 9}).encode())
    error = from_request_error(invalid("sampling.max_tokens 9 is above this server's cap of 8"), body.field_names())
    assert (error.param, error.message) == (
        "max_completion_tokens",
        "max_completion_tokens 9 is above this server's cap of 8",
    )
    error = from_request_error(invalid("sampling.logprobs must be in [0, 20], got 30"), body.field_names())
    assert (error.param, error.message) == ("top_logprobs", "top_logprobs must be in [0, 20], got 30")
    error = from_request_error(invalid("sampling.temperature must be >= 0, got -1.0"), {})
    assert (error.param, error.message) == ("temperature", "temperature must be >= 0, got -1.0")
    error = from_request_error(invalid("messages[1].content[2]: not an image"), {})
    assert (error.param, error.message) == ("messages[1].content[2]", "messages[1].content[2]: not an image")
    error = from_request_error(RequestError(grpc.StatusCode.FAILED_PRECONDITION, "sampling.n 3 too many"), {"n": "n"})
    assert error.param == "n" and error.status == 400
    assert from_request_error(invalid("sampling.n bad")).message == "sampling.n bad"  # gRPC's words without names


def test_completion_request_is_a_raw_prompt() -> None:
    body = parse(CompletionRequest, b'{"prompt": ["hello"], "logprobs": 2, "seed": 3, "n": 2, "best_of": 2}')
    proto = completion_request(body, "r")
    assert proto.prompt == "hello" and not proto.messages
    assert proto.sampling.max_tokens == 16 and proto.sampling.logprobs == 2 and proto.sampling.seed == 3


def _entry(token: str, logprob: float, *top: tuple[str, float]) -> common_pb2.TokenLogprob:
    alternatives = [common_pb2.TopLogprob(token=t, logprob=lp) for t, lp in top]
    return common_pb2.TokenLogprob(token=token, logprob=logprob, top=alternatives)


def test_text_completion_objects() -> None:
    envelope = Envelope("cmpl-1", 5, "m")
    pieces = [("He", [_entry("He", -0.5, ("He", -0.5), ("A", -1.0))]), ("llo", [_entry("llo", -2.0, ("x", -1.0))])]
    chunks = [
        generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(text=text, logprobs=entries))
        for text, entries in pieces
    ]
    final = generation_pb2.GenerateResponse(
        final=generation_pb2.Final(
            finish_reason="length", usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=2)
        )
    )
    builder = TextCompletionBuilder(envelope, logprobs=True)
    for response in [*chunks, final]:
        builder.add(response)
    whole = builder.result()
    assert whole["object"] == "text_completion" and whole["usage"]["total_tokens"] == 5
    assert whole["choices"] == [
        {
            "index": 0,
            "text": "Hello",
            "logprobs": {
                "tokens": ["He", "llo"],
                "token_logprobs": [-0.5, -2.0],
                "top_logprobs": [{"He": -0.5, "A": -1.0}, {"x": -1.0, "llo": -2.0}],
                "text_offset": [0, 2],
            },
            "finish_reason": "length",
        }
    ]
    writer = TextChunkWriter(envelope, StreamUsage(include=True), logprobs=True)
    assert writer.start() == []
    streamed = [c for response in [*chunks, final] for c in writer.add(response)]
    assert [c["choices"][0]["text"] for c in streamed[:3]] == ["He", "llo", ""]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in streamed[:2]] == [[0], [2]]
    assert streamed[2]["choices"][0]["finish_reason"] == "length"
    assert streamed[3]["choices"] == [] and streamed[3]["usage"]["completion_tokens"] == 2


def test_continuous_usage_counts_every_streamed_token() -> None:
    """vLLM's `continuous_usage_stats`: each chunk carries the usage so far, tokens whose text is held back
    included, in their own empty chunk (the prompt's count comes on the first chunk); without it, `usage: null`
    until the last chunk."""
    chunks = [
        generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(token_ids=[1], text="He", prompt_tokens=7)),
        generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(token_ids=[2, 3], text="")),  # held back
        generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(token_ids=[4], text="llo")),
    ]
    envelope = Envelope("chatcmpl-1", 0, "m")
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    assert request.continuous_usage
    writer = ChunkWriter(envelope, 1, StreamUsage(request.include_usage, request.continuous_usage))
    usages = [c["usage"] for response in chunks for c in writer.add(response)]
    assert [(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) for u in usages] == [
        (7, 1, 8),
        (7, 3, 10),
        (7, 4, 11),
    ]
    plain = ChunkWriter(envelope, 1, StreamUsage(include=True))
    assert [c["usage"] for response in chunks for c in plain.add(response)] == [None, None, None]


@pytest.mark.parametrize("usage", [StreamUsage(), StreamUsage(include=True), StreamUsage(True, True)])
def test_a_streamed_chunks_bytes_are_its_objects_encoded(usage: StreamUsage) -> None:
    """`encoded` (a content event from its choice's encoded ends) gives the bytes of `add`'s objects encoded
    whole, for any text JSON escapes, held-back tokens (empty content), several choices, the usage so far (with
    `continuous_usage_stats`) and the final's events; an id holding the hole's own text is still cut at the
    content."""
    hole = "\x00epd-content\x00"
    texts = ["plain", "", 'quote " back \\ slash', "new\nline\ttab", "\u00e9\u4e2d\U0001f600", "\x00\x1f", hole]
    chunks = [
        generation_pb2.GenerateResponse(
            chunk=generation_pb2.Chunk(text=text, token_ids=[i + 1] * (1 + i % 3), index=i % 2, prompt_tokens=3 * i)
        )
        for i, text in enumerate(texts)
    ]
    chunks.append(generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(index=1)))  # no token, no text
    final = generation_pb2.Final(
        finish_reason="length",
        usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=7),
        choices=[generation_pb2.ChoiceEnd(index=0, finish_reason="length"), generation_pb2.ChoiceEnd(index=1)],
    )
    for envelope in (Envelope("chatcmpl-1", 5, "m"), Envelope(f"chatcmpl-{hole}", 5, f"model {hole}")):
        fast = ChunkWriter(envelope, 2, StreamUsage(usage.include, usage.continuous))
        slow = ChunkWriter(envelope, 2, StreamUsage(usage.include, usage.continuous))
        for response in [*chunks, generation_pb2.GenerateResponse(final=final)]:
            assert fast.encoded(response) == sse_all(slow.add(response))


def test_openapi_document_states_the_request_models() -> None:
    api = HttpApi(None, None, lambda: None, lambda: None, None, "m", 100, 1.0, 1 << 20, 128 << 10, "1.2.3")  # type: ignore[arg-type]
    doc = build_app(api).openapi()
    assert doc["info"]["version"] == "1.2.3"
    schemas = doc["components"]["schemas"]
    own = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schemas["ChatCompletionRequest"] == {key: value for key, value in own.items() if key != "$defs"}
    assert all(schemas[name] == schema for name, schema in own["$defs"].items())
    assert schemas["ChatCompletionRequest"]["dependentSchemas"]["stream_options"]["required"] == ["stream"]
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "security" not in doc["paths"]["/health"]["get"] and "422" not in str(doc["paths"])


def test_api_doc_lists_every_refused_field() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    assert [name for name in REFUSED if f"`{name}`" not in doc] == []


def _sampling(**fields: Any) -> common_pb2.SamplingParams:
    return generate_request(
        parse(ChatCompletionRequest, json.dumps({"messages": USER, **fields}).encode()), "r"
    ).sampling


def test_structured_output_fields_become_the_protos_oneof_and_errors_name_them() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    text = json.dumps(schema)
    for fields, expected in [
        ({"response_format": as_schema}, common_pb2.SamplingParams(json_schema=text)),
        ({"response_format": {"type": "json_object"}}, common_pb2.SamplingParams(json_object=True)),
        ({"response_format": {"type": "text"}}, common_pb2.SamplingParams()),
        ({"structured_outputs": {"json": schema}}, common_pb2.SamplingParams(json_schema=text)),
        (
            {"structured_outputs": {"json": '{"type": "string"}'}},
            common_pb2.SamplingParams(json_schema='{"type": "string"}'),
        ),
        ({"guided_json": schema}, common_pb2.SamplingParams(json_schema=text)),
        ({"structured_outputs": {"regex": "a+"}}, common_pb2.SamplingParams(regex="a+")),
        ({"guided_regex": "a+"}, common_pb2.SamplingParams(regex="a+")),
        ({"guided_choice": ["a", "b"]}, common_pb2.SamplingParams(choice=common_pb2.Choices(choices=["a", "b"]))),
        ({"guided_grammar": 'root ::= "a"'}, common_pb2.SamplingParams(grammar='root ::= "a"')),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
            common_pb2.SamplingParams(json_object=True, any_whitespace=True),
        ),
    ]:
        got = _sampling(**fields)
        structured = common_pb2.SamplingParams()
        structured.CopyFrom(got)
        for name in ("max_tokens", "temperature", "top_p", "n"):
            structured.ClearField(name)
        assert structured == expected, fields
    assert refusal({"messages": USER, "guided_regex": "a", "response_format": {"type": "json_object"}}) == (
        "guided_regex",
        "one structured-output constraint per request, got response_format and guided_regex",
    )
    assert (
        refusal({"messages": USER, "structured_outputs": {"structural_tag": "x"}})[0]
        == "structured_outputs.structural_tag"
    )
    assert refusal({"messages": USER, "guided_whitespace_pattern": " "})[0] == "guided_whitespace_pattern"
    body = parse(ChatCompletionRequest, json.dumps({"messages": USER, "response_format": as_schema}).encode())
    error = from_request_error(invalid("sampling.json_schema does not compile: x"), body.field_names())
    assert (error.param, error.message) == (
        "response_format.json_schema.schema",
        "response_format.json_schema.schema does not compile: x",
    )


def test_tools_become_the_requests_tools_and_are_refused_on_completions() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    body = parse(
        ChatCompletionRequest,
        json.dumps(
            {"messages": USER, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
        ).encode(),
    )
    proto = generate_request(body, "r")
    assert list(proto.tools) == [generation_pb2.Tool(name="f", description="d", parameters='{"type": "object"}')]
    assert proto.tool_choice == generation_pb2.ToolChoice(mode="function", function="f")
    assert body.offers_tools
    none = parse(ChatCompletionRequest, json.dumps({"messages": USER, "tools": [tool], "tool_choice": "none"}).encode())
    assert not none.offers_tools and generate_request(none, "r").tool_choice.mode == "none"
    assert refusal({"prompt": "x", "tools": [tool]}, CompletionRequest)[0] == "tools"


def test_past_calls_and_tool_results_are_written_as_qwens_template_writes_them() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "content": "22C"},
        {"role": "assistant", "content": "Sunny, 22C.", "tool_calls": [call]},
    ]
    proto = generate_request(parse(ChatCompletionRequest, json.dumps({"messages": messages}).encode()), "r")
    assert [(m.role, "".join(p.text for p in m.content)) for m in proto.messages] == [
        ("user", "weather?"),
        ("assistant", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ("user", "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>"),
        (
            "assistant",
            'Sunny, 22C.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ),
    ]
    bad = {**call, "function": {"name": "f", "arguments": "[1]"}}
    assert refusal({"messages": [{"role": "assistant", "tool_calls": [bad]}]}) == (
        "messages[0].tool_calls[0].function.arguments",
        "messages[0].tool_calls[0].function.arguments: must be a JSON object (as text)",
    )
    assert (
        refusal({"messages": [{"role": "tool", "content": "x", "tool_calls": [call]}]})[0] == "messages[0].tool_calls"
    )
