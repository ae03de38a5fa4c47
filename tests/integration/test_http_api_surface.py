"""The HTTP API's surface against a real cluster (router, encoder, worker, Redis): its served OpenAPI document
fuzzed by schemathesis (random and boundary cases) without a 5xx; bounds, `null`, NaN and refused fields
answered 400 in the API's own field names and counted; `/v1/completions`, `/tokenize`, `/detokenize`,
`/version`, and 405's `Allow`; structured outputs (`response_format`, vLLM's `structured_outputs` and
`guided_*`) through the official client, and hostile constraints refused before any worker reserves.

The cluster caps max_tokens at 16 (default 4), so every generated request the fuzzer sends is short.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pydantic
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import GenerationConfig
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance
from transformers import AutoTokenizer

from services.client import Client
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.launch.local import LocalCluster
from services.router.openai_request import REFUSED
from tests import media_factory
from tests.integration.conftest import RedisServer, metric_value, module_cluster

CAP = 16
MAX_N = 4
U32 = 1 << 32
MESSAGES = [{"role": "user", "content": "Say something about cats."}]


@dataclass
class Surface:
    local: LocalCluster
    model_dir: Path

    @property
    def url(self) -> str:
        return self.local.http_url

    @property
    def model(self) -> str:
        return self.model_dir.resolve().name

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def metric(self, name: str) -> float:
        return metric_value(self.local.router.metrics_port, name)


@pytest.fixture(scope="module")
def surface(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Surface]:
    env = {"EPD_DEFAULT_MAX_TOKENS": "4", "EPD_MAX_TOKENS_CAP": str(CAP), "EPD_MAX_N": str(MAX_N)}
    for local in module_cluster(tiny_model_dir, redis_server, tmp_path_factory, env=env):
        yield Surface(local, tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def api_schema(surface: Surface) -> Any:
    return schemathesis.openapi.from_url(f"{surface.url}/openapi.json")


OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/count_tokens",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "GET /health",
    "GET /version",
]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]
FUZZ_CASES = 30  # per operation and mode: about a second each on two cores
MODES = [(label, schemathesis.GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, schemathesis.GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")
]  # a GET without parameters has no invalid request to generate


@pytest.mark.parametrize(("label", "mode"), MODES, ids=[f"{label} {mode.value}" for label, mode in MODES])
def test_fuzzed_requests_never_get_a_server_error(api_schema: Any, label: str, mode: Any) -> None:
    """Requests generated from our own served document (valid bodies, and bodies that break it): never a 5xx,
    and every status and content type is one the document lists. (schemathesis' own pytest plugin does not
    run under pytest 9, so its strategies are driven by hypothesis here.)"""
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(case: Any) -> None:
        case.call_and_validate(checks=CHECKS)

    run()


@pytest.mark.parametrize("label", OPERATIONS)
def test_boundary_requests_never_get_a_server_error(api_schema: Any, label: str) -> None:
    """schemathesis' coverage cases, deterministic: each field at and past its bounds, of the wrong type,
    missing, plus the methods a path does not take (405 with `Allow`)."""
    operation = api_schema.find_operation_by_label(label)
    cases = list(
        api_schema.iter_coverage_cases(
            operation, generation_modes=list(schemathesis.GenerationMode), generation_config=GenerationConfig()
        )
    )
    assert cases
    for case in cases:
        case.call_and_validate(checks=CHECKS)


def test_openapi_document_and_docs_are_served(surface: Surface) -> None:
    doc = httpx.get(f"{surface.url}/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    assert sorted(OPERATIONS) == sorted(f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item)
    paths = {"/v1/chat/completions", "/v1/completions", "/v1/count_tokens", "/tokenize", "/detokenize"}
    for path in paths:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].split("/")[-1] in doc["components"]["schemas"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["n"]["anyOf"][0]["maximum"] == U32 - 1 and {"type": "null"} in chat["n"]["anyOf"]
    page = httpx.get(f"{surface.url}/docs", timeout=10)
    assert page.status_code == 200 and "/openapi.json" in page.text


BOUNDS = {
    "n": ("n", U32 - 1),
    "max_tokens": ("max_tokens", U32 - 1),
    "max_completion_tokens": ("max_completion_tokens", U32 - 1),
    "top_k": ("top_k", U32 - 1),
    "seed": ("seed", (1 << 64) - 1),
}


def test_integers_past_the_protos_bounds_are_400_naming_the_field_and_counted(surface: Surface) -> None:
    invalid_before = surface.metric("epd_requests_total")
    counts_before = surface.metric("epd_count_tokens_requests_total")
    for path in ("/v1/chat/completions", "/v1/count_tokens"):
        for field, (_, bound) in BOUNDS.items():
            error = error_of(surface.post(path, {"messages": MESSAGES, field: bound + 1}))
            assert error["param"] == field and error["code"] == "invalid_argument"
            assert error["message"] == f"{field}: must be <= {bound}, got {bound + 1}"
    error = error_of(surface.post("/v1/completions", {"prompt": "hi", "logprobs": 21}))
    assert (error["param"], error["message"]) == ("logprobs", "logprobs: must be <= 20, got 21")
    assert surface.metric("epd_requests_total") == invalid_before + len(BOUNDS) + 1
    assert surface.metric("epd_count_tokens_requests_total") == counts_before + len(BOUNDS)


NULLABLE = [
    "n", "stream", "logprobs", "top_logprobs", "top_p", "stop", "seed", "max_tokens", "max_completion_tokens",
    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "tools", "tool_choice",
    "response_format", "user", "top_k", "ignore_eos", "cache_salt", "best_of",
]  # fmt: skip


def test_null_means_not_set(surface: Surface) -> None:
    plain = {"messages": MESSAGES, "temperature": 0, "max_tokens": 6}
    expected = surface.post("/v1/chat/completions", plain).json()["choices"][0]["message"]["content"]
    nulls = {**{field: None for field in NULLABLE}, **plain}
    answer = surface.post("/v1/chat/completions", nulls)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == expected
    seeded = {"messages": MESSAGES, "max_tokens": 6, "seed": 3}
    sampled = surface.post("/v1/chat/completions", {**seeded, "temperature": 1.0}).json()
    assert surface.post("/v1/chat/completions", {**seeded, "temperature": None}).json()["choices"] == sampled["choices"]
    turns = [*MESSAGES, {"role": "assistant", "content": None}, {"role": "user", "content": "And dogs?"}]
    assert surface.post("/v1/chat/completions", {"messages": turns, "max_tokens": 2}).status_code == 200
    error = error_of(surface.post("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}))
    assert error["param"] == "messages[0].content"


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e39"])
def test_nan_and_infinity_are_400(surface: Surface, field: str, value: str) -> None:
    raw = f'{{"messages": {json.dumps(MESSAGES)}, "{field}": {value}}}'
    response = httpx.post(
        f"{surface.url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30
    )
    error = error_of(response)
    assert error["param"] == field and error["message"].startswith(f"{field}: must be")


def grpc_details(surface: Surface, **sampling: Any) -> str:
    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.Message(role="user", content=[generation_pb2.ContentPart(text="hi")])],
        sampling=common_pb2.SamplingParams(**sampling),
    )
    with Client(surface.local.address) as client, pytest.raises(grpc.RpcError) as info:
        client.generate(request, timeout_s=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details()


def test_the_routers_rules_answer_in_http_field_names(surface: Surface) -> None:
    """The router's own checks (one rule set for gRPC and HTTP) give gRPC's message with the field the HTTP
    body sent in place of the SamplingParams field."""
    cases = [  # HTTP field and value, SamplingParams field and value
        ("temperature", -1, "temperature", -1.0),
        ("top_p", 2, "top_p", 2.0),
        ("n", MAX_N + 1, "n", MAX_N + 1),
        ("max_completion_tokens", CAP + 1, "max_tokens", CAP + 1),
        ("max_tokens", CAP + 1, "max_tokens", CAP + 1),
        ("stop", ["x"] * 17, "stop", ["x"] * 17),
    ]
    for field, value, proto_field, proto_value in cases:
        error = error_of(surface.post("/v1/chat/completions", {"messages": MESSAGES, field: value}))
        said = grpc_details(surface, **{"max_tokens": 4, proto_field: proto_value})
        prefix = f"sampling.{proto_field}"
        assert said.startswith(prefix), said
        assert (error["param"], error["message"]) == (field, field + said.removeprefix(prefix))


def test_content_part_errors_name_the_part(surface: Surface) -> None:
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    error = error_of(surface.post("/v1/chat/completions", {"messages": audio}))
    assert error["param"] == "messages[0].content[0].type"
    assert "'input_audio' is not supported" in error["message"] and ".str" not in error["message"]
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    error = error_of(surface.post("/v1/chat/completions", {"messages": bad}))
    assert error["param"] == "messages[0].content[0]" and error["message"].startswith("messages[0].content[0]: ")


def test_every_refused_field_is_400_naming_it(surface: Surface) -> None:
    before = surface.metric("epd_requests_total")
    for field in REFUSED:
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
            error = error_of(surface.post(path, {**body, field: "something"}))
            assert error["param"] == field and "not supported" in error["message"], error
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        for field, neutral in (("best_of", 2), ("add_special_tokens", "x")):
            assert error_of(surface.post(path, {**body, field: neutral}))["param"] == field
    assert surface.metric("epd_requests_total") == before + 2 * len(REFUSED) + 4
    neutral = {"repetition_penalty": 1.0, "min_p": 0, "presence_penalty": 0, "tool_choice": "none", "best_of": 1}
    assert surface.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **neutral}).status_code == 200


def rendered(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_completions_of_the_rendered_chat_equal_the_chat_completion(surface: Surface, tokenizer: Any) -> None:
    prompt = rendered(tokenizer, MESSAGES)
    chat = surface.post("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 8}).json()
    client = openai.OpenAI(base_url=f"{surface.url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=surface.model, prompt=prompt, temperature=0, max_tokens=8)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text == chat["choices"][0]["message"]["content"]
    assert completion.choices[0].finish_reason == chat["choices"][0]["finish_reason"]
    assert completion.usage.prompt_tokens == chat["usage"]["prompt_tokens"]
    streamed = list(
        client.completions.create(
            model=surface.model,
            prompt=[prompt],
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == completion.usage.completion_tokens
    with_logprobs = client.completions.create(
        model=surface.model, prompt=prompt, temperature=0, max_tokens=8, logprobs=2
    )
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == with_logprobs.usage.completion_tokens
    assert all(len(top) >= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0
    client.close()


def test_completion_prompts_are_checked(surface: Surface) -> None:
    error = error_of(surface.post("/v1/completions", {"prompt": "look: <|image_pad|>"}))
    assert error["param"] == "prompt" and "placeholder" in error["message"]
    error = error_of(surface.post("/v1/completions", {"prompt": [1, 2, 3]}))
    assert error["param"] == "prompt" and "token-id prompts" in error["message"]
    error = error_of(surface.post("/v1/completions", {"prompt": "hi", "max_tokens": CAP + 1}))
    assert error["param"] == "max_tokens" and "cap" in error["message"]


def test_tokenize_and_detokenize(surface: Surface, tokenizer: Any) -> None:
    prompt = rendered(tokenizer, MESSAGES)
    answer = surface.post("/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    ids = tokenizer(prompt)["input_ids"]
    assert answer["tokens"] == ids and answer["count"] == len(ids) > 0
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids) and answer["max_model_len"] > len(ids)
    chat = surface.post("/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == ids and chat["token_strs"] is None
    image = f"data:image/png;base64,{__import__('base64').b64encode(media_factory.png(64, 64, seed=2)).decode()}"
    with_image = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}],
        }
    ]
    counted = surface.post("/v1/count_tokens", {"messages": with_image}).json()
    assert surface.post("/tokenize", {"messages": with_image}).json()["count"] == counted["prompt_tokens"]
    assert surface.post("/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    error = error_of(surface.post("/detokenize", {"tokens": [ids[0], len(tokenizer)]}))
    assert error["param"] == "tokens[1]"
    assert error_of(surface.post("/tokenize", {"prompt": "a", "messages": MESSAGES}))["param"] == "prompt"


def test_version_and_method_not_allowed(surface: Surface) -> None:
    version = httpx.get(f"{surface.url}/version", timeout=10)
    assert version.status_code == 200 and isinstance(version.json()["version"], str) and version.json()["version"]
    response = httpx.get(f"{surface.url}/v1/chat/completions", timeout=10)
    assert error_of(response, 405)["code"] == "method_not_allowed"
    assert response.headers["allow"] == "POST"
    response = httpx.delete(f"{surface.url}/v1/models", timeout=10)
    assert error_of(response, 405)["code"] == "method_not_allowed" and response.headers["allow"] == "GET"


def test_grpc_takes_the_same_raw_prompt(surface: Surface, tokenizer: Any) -> None:
    prompt = rendered(tokenizer, MESSAGES)
    http = surface.post("/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 8}).json()
    with Client(surface.local.address) as client:
        answer = client.generate(
            generation_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=8))
        )
        assert answer.text == http["choices"][0]["text"]
        assert answer.final.usage.prompt_tokens == http["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
        both = generation_pb2.GenerateRequest(prompt=prompt, messages=[generation_pb2.Message(role="user")])
        with pytest.raises(grpc.RpcError) as info:
            client.generate(both, timeout_s=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in info.value.details()


class Answer(pydantic.BaseModel):
    ok: bool


def _chat(client: openai.OpenAI, surface: Surface, **fields: Any) -> Any:
    return client.chat.completions.create(model=surface.model, messages=MESSAGES, max_tokens=CAP, **fields)


def test_structured_outputs_follow_their_constraint(surface: Surface) -> None:
    """The official client parses `response_format` json_schema answers into its typed objects, streamed and
    not; json_object, vLLM's `structured_outputs` and `guided_*` fields constrain the text; n=2 with a seed and
    a stop string inside the constrained text work with it."""
    client = openai.OpenAI(base_url=f"{surface.url}/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.parse(
        model=surface.model, messages=MESSAGES, response_format=Answer, temperature=0, max_tokens=CAP
    )
    assert whole.choices[0].finish_reason == "stop" and isinstance(whole.choices[0].message.parsed, Answer)
    assert whole.choices[0].message.content == json.dumps(whole.choices[0].message.parsed.model_dump())
    with client.chat.completions.stream(
        model=surface.model, messages=MESSAGES, response_format=Answer, temperature=0, max_tokens=CAP
    ) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == whole.choices[0].message.parsed
    sampled = _chat(client, surface, response_format={"type": "json_object"}, n=2, seed=5, temperature=1.0)
    assert len(sampled.choices) == 2
    for choice in sampled.choices:
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
    cases = [
        ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text)),
        ({"guided_regex": "(yes|no)!"}, lambda text: text in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda text: text in ("red", "green")),
        ({"guided_choice": ["up", "down"]}, lambda text: text in ("up", "down")),
        ({"structured_outputs": {"grammar": 'root ::= "(" [0-9] ")"'}}, lambda text: re.fullmatch(r"\(\d\)", text)),
        ({"guided_json": {"enum": [1, 2]}}, lambda text: json.loads(text) in (1, 2)),
        ({"structured_outputs": {"json": '{"type": "boolean"}'}}, lambda text: text in ("true", "false")),
    ]
    for extra, valid in cases:
        answer = _chat(client, surface, temperature=0, extra_body=extra).choices[0]
        assert answer.finish_reason == "stop" and valid(answer.message.content), (extra, answer)
    cut = _chat(client, surface, temperature=0, stop=[" beta"], extra_body={"guided_choice": ["alpha beta gamma"]})
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("alpha", "stop")
    text = surface.post("/v1/completions", {"prompt": "hi", "max_tokens": CAP, "guided_choice": ["yes", "no"]})
    assert text.status_code == 200 and text.json()["choices"][0]["text"] in ("yes", "no")
    client.close()


HUGE = "x" * 10_000_000
HOSTILE = {
    "10 MB schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": HUGE}}}},
        "response_format.json_schema.schema",
        "above this server's limit",
    ),
    "100-deep schema": (
        {"guided_json": functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(100), {})},
        "guided_json",
        "nested deeper than this server's limit of 64",
    ),
    "catastrophic regex": (
        {"structured_outputs": {"regex": "(x*x*)*y"}},
        "structured_outputs.regex",
        "repeats a group that repeats without bound or can match nothing",
    ),
    "unknown format": (
        {"guided_json": {"type": "string", "format": "credit-card"}},
        "guided_json",
        "format 'credit-card' is not supported",
    ),
    "regex the library refuses": (
        {"guided_regex": "(?=a)b"},
        "guided_regex",
        "does not compile: Regex parsing error at position 3: Lookahead is not supported yet",
    ),
    "schema that does not compile": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
        "response_format.json_schema.schema",
        'does not compile: Unsupported type "strin"',
    ),
    "grammar that does not parse": (
        {"structured_outputs": {"grammar": "root ::= "}},
        "structured_outputs.grammar",
        "does not compile: EBNF parser error",
    ),
    "two constraints": (
        {"guided_regex": "a", "guided_choice": ["a"]},
        "guided_choice",
        "one structured-output constraint per request",
    ),
}


def test_hostile_constraints_are_refused_before_any_worker_reserves(surface: Surface) -> None:
    """Each is a 400 naming the field and the problem, counted, and no request reached admission (the
    router's queue-time histogram, recorded once per admitted attempt, and the worker's prompt tokens stay)."""
    admitted = surface.metric("epd_request_queue_time_seconds_count")
    served = metric_value(surface.local.workers[0].metrics_port, "epd_prompt_tokens_total")
    refused = surface.metric("epd_requests_total")
    for name, (extra, param, said) in HOSTILE.items():
        error = error_of(surface.post("/v1/chat/completions", {"messages": MESSAGES, **extra}))
        assert error["param"] == param and said in error["message"], (name, error)
    deep = '{"messages": [{"role": "user", "content": "x"}], "guided_json": ' + "[" * 10_000 + "]" * 10_000 + "}"
    response = httpx.post(
        f"{surface.url}/v1/chat/completions", content=deep, headers={"content-type": "application/json"}, timeout=60
    )
    assert "nested too deeply" in error_of(response)["message"]
    with Client(surface.local.address) as client, pytest.raises(grpc.RpcError) as info:
        sampling = common_pb2.SamplingParams(max_tokens=4, regex="(a+b)+")
        client.generate(generation_pb2.GenerateRequest(prompt="hi", sampling=sampling), timeout_s=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.regex repeats a group")
    assert surface.metric("epd_request_queue_time_seconds_count") == admitted
    assert metric_value(surface.local.workers[0].metrics_port, "epd_prompt_tokens_total") == served
    assert surface.metric("epd_requests_total") >= refused + len(HOSTILE)
    fine = surface.post("/v1/chat/completions", {"messages": MESSAGES, "guided_choice": ["a"], "max_tokens": 4})
    assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["content"] == "a"
    assert surface.metric("epd_request_queue_time_seconds_count") == admitted + 1  # the counts do move
    assert metric_value(surface.local.workers[0].metrics_port, "epd_prompt_tokens_total") > served
