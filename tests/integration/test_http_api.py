"""The OpenAI-compatible HTTP API for real: the official `openai` client against router, encoder and worker
processes and a real Redis, every answer checked against the gRPC API's answer to the same request.

Tool calls (required, named, auto, none) parse into the client's objects, and 16 concurrent constrained, plain
and image requests equal transformers' `generate` with xgrammar's processor.

The worker's KV holds 512 blocks of 16 tokens, so one long request (7000 tokens) leaves too little for a
second one (429), and a request of 8192 new tokens can never fit (400).
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pydantic
import pytest
import xgrammar as xgr
from PIL import Image
from transformers import AutoTokenizer

from services.client import Client, user_request
from services.common.grammar_cache import tokenizer_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import common_pb2, generation_pb2
from services.launch.health import wait_healthy
from services.launch.local import ClusterSpec, LocalCluster, free_port, spawn, start_cluster
from services.models.base import ChatMessage, ChatPart
from services.worker.engine.request import SamplingOptions
from tests import loopback_http, media_factory
from tests.integration.conftest import RedisServer
from tests.kv_sampler import KVSampler
from tests.structured_support import CONSTRAINTS, check_valid, oracle, set_structured

BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # K and V x layers x kv heads x head dim x block size x fp32 (tiny model)
KV_BLOCKS = 512
MAX_ITEM_BYTES = 1 << 20
MAX_REQUEST_BYTES = 2 << 20
MAX_TOKENS = 12
LONG_TOKENS = 7000  # 440+ of the 512 blocks, and seconds of decoding
PROMPT = "Describe the picture."
IMAGES = [media_factory.png(64, 96, seed=5), media_factory.jpeg(150, 80, seed=6)]


@dataclass
class Api:
    local: LocalCluster
    model_dir: Path
    grpc: Client
    openai: openai.OpenAI
    registry: Registry

    @property
    def model(self) -> str:
        return self.model_dir.resolve().name

    @property
    def url(self) -> str:
        return self.local.http_url

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout_s)


@pytest.fixture(scope="module")
def api(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    env = {
        "EPD_FETCH_ALLOW_LOOPBACK_FOR_TESTS": "true",
        "EPD_KV_CACHE_BYTES": str(KV_BLOCKS * BLOCK_BYTES),
        "EPD_MAX_ITEM_BYTES": str(MAX_ITEM_BYTES),
        "EPD_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
    }
    spec = ClusterSpec(
        tiny_model_dir, redis_url=redis_server.url, free_ports=True, env=env, log_dir=tmp_path_factory.mktemp("logs")
    )
    local = start_cluster(spec)
    client = openai.OpenAI(base_url=f"{local.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    api = Api(local, tiny_model_dir, Client(local.address), client, Registry(redis_server.url))
    yield api
    client.close()
    api.grpc.close()
    local.stop()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(prompt: str, urls: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One user turn for the HTTP API: the images first, then the text (as `user_request` lays it out)."""
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


def grpc_request(prompt: str, urls: Sequence[str] = (), **sampling: Any) -> generation_pb2.GenerateRequest:
    """The same turn for gRPC, built independently of the HTTP API's translation."""
    parts = [generation_pb2.ContentPart(image=generation_pb2.Media(url=url)) for url in urls]
    parts.append(generation_pb2.ContentPart(text=prompt))
    return generation_pb2.GenerateRequest(
        messages=[generation_pb2.Message(role="user", content=parts)], sampling=common_pb2.SamplingParams(**sampling)
    )


def worker_states(api: Api) -> list[dict[str, Any]]:
    return [m.state for m in api.registry.members("worker") or []]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def all_blocks_free(api: Api) -> bool:
    states = worker_states(api)
    return bool(states) and all(
        s["free_blocks"] == s["total_blocks"] and s["reserved_blocks"] == 0 and s["running"] == 0 for s in states
    )


def router_metric(api: Api, name: str, label: str) -> float:
    """The sum of the router's `name{...label...}` samples on its Prometheus endpoint."""
    text = httpx.get(f"http://127.0.0.1:{api.local.router.metrics_port}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line
    )


def router_requests(api: Api, outcome: str) -> float:
    """The router's `epd_requests_total{outcome=...}`: HTTP requests are counted as gRPC ones are."""
    return router_metric(api, "epd_requests_total", f'outcome="{outcome}"')


def error_body(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response, checked for its exact shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def grpc_error(api: Api, request: generation_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        api.grpc.generate(request, timeout_s=60)
    return info.value


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("images", [1, 2])
def test_greedy_chat_equals_grpc(api: Api, images: int, stream: bool) -> None:
    pictures = IMAGES[:images]
    expected = api.grpc.generate(user_request(PROMPT, pictures, max_tokens=MAX_TOKENS))
    messages = chat(PROMPT, [data_url(p) for p in pictures])
    create = api.openai.chat.completions.create
    if stream:
        chunks = list(
            create(
                model=api.model,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    else:
        completion = create(model=api.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert completion.object == "chat.completion" and completion.model == api.model
        text, finish, usage = (
            completion.choices[0].message.content,
            [completion.choices[0].finish_reason],
            completion.usage,
        )
    assert text and text == expected.text
    assert finish == [expected.final.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        expected.final.usage.prompt_tokens,
        expected.final.usage.completion_tokens,
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.model_extra["image_tokens"] == expected.final.usage.image_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens > 0  # the gRPC call just cached this prompt's blocks


def test_count_tokens_equals_grpc(api: Api) -> None:
    urls = [data_url(p) for p in IMAGES]
    response = api.post("/v1/count_tokens", {"model": api.model, "messages": chat(PROMPT, urls), "max_tokens": 30})
    assert response.status_code == 200, response.text
    count = api.grpc.count(user_request(PROMPT, IMAGES, max_tokens=30))
    assert response.json() == {
        "object": "token_count",
        "prompt_tokens": count.prompt_tokens,
        "text_tokens": count.text_tokens,
        "image_tokens": count.image_tokens,
        "video_tokens": 0,
        "max_tokens": 30,
        "projected_tokens": count.prompt_tokens + 30,
        "tokens_per_item": list(count.tokens_per_item),
    }


def test_models_and_health(api: Api) -> None:
    assert [m.id for m in api.openai.models.list().data] == [api.model]
    assert api.openai.models.retrieve(api.model).owned_by == "epd"
    health = httpx.get(f"{api.url}/health", timeout=10)
    assert (health.status_code, health.json()) == (200, {"status": "ok", "workers": 1})


@contextmanager
def extra_router(api: Api, tmp_path: Path, redis_url: str, **env: str) -> Iterator[str]:
    """One more router for the same model with its own settings; yields its HTTP base URL."""
    http_port = free_port()
    settings = {"EPD_MODEL": str(api.model_dir), "EPD_REDIS_URL": redis_url, "EPD_HTTP_PORT": str(http_port), **env}
    router = spawn("router", free_port(), free_port(), settings, tmp_path)
    try:
        wait_healthy(router.address, 120, alive=lambda: router.popen.poll() is None)
        yield f"http://127.0.0.1:{http_port}"
    finally:
        router.popen.terminate()
        router.popen.wait(10)


def test_health_and_requests_without_a_worker_are_503(api: Api, redis_server: RedisServer, tmp_path: Path) -> None:
    empty = redis_server.url.rsplit("/", 1)[0] + "/1"  # a database no service registers in
    with extra_router(api, tmp_path, empty, EPD_ADMISSION_MAX_WAIT_S="0.2") as url:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503
        assert error_body(health)["code"] == "unavailable"
        answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": chat("hello")}, timeout=30)
        assert answer.status_code == 503
        assert error_body(answer) == {
            "message": "no healthy worker is registered",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }


def _bad_inputs() -> dict[str, tuple[list[str], dict[str, Any]]]:
    """name -> (image URLs, extra fields), each refused with 400 and gRPC's INVALID_ARGUMENT message."""
    small = data_url(media_factory.png(32, 32, seed=1))
    return {
        "bad_image_bytes": ([data_url(b"\x89PNG\r\n\x1a\nthis is not a png")], {}),
        "too_many_images": ([small] * 9, {}),
        "private_address_url": (["https://10.0.0.1/x.png"], {}),
        "max_tokens_over_cap": ([], {"max_tokens": 8193}),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_input_is_400_with_grpcs_message(api: Api, name: str) -> None:
    """gRPC's message, in the HTTP API's field names (`sampling.max_tokens` is `max_tokens`), `param` the
    field or content part at fault."""
    urls, extra = _bad_inputs()[name]
    with pytest.raises(openai.BadRequestError) as info:
        api.openai.chat.completions.create(model=api.model, messages=chat(PROMPT, urls), **extra)
    error = error_body(info.value.response)
    expected = grpc_error(api, grpc_request(PROMPT, urls, max_tokens=extra.get("max_tokens", 0)))
    assert expected.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = expected.details()
    param = "max_tokens" if message.startswith("sampling.max_tokens") else message.split(":", 1)[0]
    assert param in ("max_tokens", "messages[0].content[0]", "messages[0].content[8]"), message
    assert error == {
        "message": message.removeprefix("sampling."),
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_argument",
    }


def test_too_large_is_413(api: Api) -> None:
    big = data_url(bytes(MAX_ITEM_BYTES + 1000))
    response = api.post("/v1/chat/completions", {"messages": chat(PROMPT, [big])})
    assert response.status_code == 413
    expected = grpc_error(api, grpc_request(PROMPT, [big]))
    assert error_body(response)["message"] == expected.details() and "limit" in expected.details()
    body = b'{"messages": [], "pad": "' + b"x" * (4 << 20) + b'"}'  # over the body cap, whatever it holds
    response = httpx.post(
        f"{api.url}/v1/chat/completions", content=body, timeout=60, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert "request body" in error_body(response)["message"]


def test_never_fits_is_400(api: Api) -> None:
    response = api.post("/v1/chat/completions", {"messages": chat("hello"), "max_tokens": 8192})
    assert response.status_code == 400
    error = error_body(response)
    expected = grpc_error(api, grpc_request("hello", max_tokens=8192))
    assert expected.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error["code"] == "failed_precondition"
    assert error["message"].startswith(expected.details()) and "never fit" in error["message"]


def test_invalid_bodies_are_400(api: Api) -> None:
    cases = {
        "messages: expected an array, got a string": {"messages": "hello"},
        "tools[0].function: required": {"messages": chat("hi"), "tools": [{"type": "function"}]},
        "functions is not supported": {"messages": chat("hi"), "functions": [{"name": "f"}]},
        "stream_options is only allowed with stream=true": {
            "messages": chat("hi"),
            "stream_options": {"include_usage": True},
        },
        "top_logprobs needs logprobs=true": {"messages": chat("hi"), "top_logprobs": 2},
    }
    for needle, body in cases.items():
        response = api.post("/v1/chat/completions", body)
        assert response.status_code == 400, response.text
        assert error_body(response)["message"].startswith(needle)
    response = httpx.post(f"{api.url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400 and error_body(response)["code"] == "invalid_argument"
    with pytest.raises(openai.NotFoundError) as info:
        api.openai.chat.completions.create(model="gpt-4o", messages=chat("hi"))
    assert error_body(info.value.response)["code"] == "model_not_found"


def _long(stream: bool) -> dict[str, Any]:
    return {
        "messages": chat("tell me a very long story"),
        "max_tokens": LONG_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


def test_overload_is_429_and_a_dropped_stream_frees_its_blocks(api: Api) -> None:
    cancelled = router_requests(api, "cancelled")
    refused = router_metric(api, "epd_admission_rejections_total", 'reason="cluster_full"')
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{api.url}/v1/chat/completions", json=_long(True)) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: dropping the iterator would close the connection already
        assert next(line for line in lines if '"content":' in line)
        wait_for(lambda: any(s["reserved_blocks"] > 0 for s in worker_states(api)), "the long request's blocks")
        with pytest.raises(openai.RateLimitError) as info:
            api.openai.chat.completions.create(model=api.model, messages=chat("one more"), max_tokens=2000)
        response = info.value.response
        assert int(response.headers["retry-after"]) >= 1 and int(response.headers["retry-after-ms"]) > 0
        error = error_body(response)
        assert (error["type"], error["code"]) == ("rate_limit_error", "resource_exhausted")
        assert "KV blocks" in error["message"]
        assert router_metric(api, "epd_admission_rejections_total", 'reason="cluster_full"') == refused + 1
    # the connection closed mid-stream: the router cancels the request and the worker frees its blocks
    wait_for(lambda: all_blocks_free(api), "every KV block to be free again")
    assert router_requests(api, "cancelled") == cancelled + 1


def test_a_dropped_whole_answer_frees_its_blocks(api: Api) -> None:
    cancelled = router_requests(api, "cancelled")
    with KVSampler(api.registry) as sampler, pytest.raises(httpx.ReadTimeout):
        api.post("/v1/chat/completions", _long(False), timeout_s=1.5)
    assert sampler.peaks()["max_reserved_blocks"] > 0, "the request never held blocks"
    wait_for(lambda: all_blocks_free(api), "every KV block to be free again")
    assert router_requests(api, "cancelled") == cancelled + 1


def test_deadline_is_504(api: Api, redis_server: RedisServer, tmp_path: Path) -> None:
    with extra_router(api, tmp_path, redis_server.url, EPD_REQUEST_TIMEOUT_S="0.5") as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=_long(False), timeout=60)
        assert response.status_code == 504, response.text
        assert error_body(response)["code"] == "deadline_exceeded"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        received = []
        with pytest.raises(openai.APIError) as info:  # the status line has gone: the error comes as an event
            for chunk in client.chat.completions.create(
                model=api.model,
                messages=chat("a story"),
                stream=True,
                max_tokens=LONG_TOKENS,
                extra_body={"ignore_eos": True},
            ):
                received.append(chunk)
        assert received and "deadline" in str(info.value).lower()
    wait_for(lambda: all_blocks_free(api), "every KV block to be free again")


@dataclass
class GrpcChoices:
    texts: dict[int, str]
    logprobs: dict[int, list[common_pb2.TokenLogprob]]
    final: generation_pb2.Final


def grpc_choices(api: Api, request: generation_pb2.GenerateRequest) -> GrpcChoices:
    """The gRPC answer gathered per choice index."""
    texts: dict[int, str] = defaultdict(str)
    logprobs: dict[int, list[common_pb2.TokenLogprob]] = defaultdict(list)
    final = None
    for response in api.grpc.stream(request):
        if response.HasField("chunk"):
            texts[response.chunk.index] += response.chunk.text
            logprobs[response.chunk.index].extend(response.chunk.logprobs)
        else:
            final = response.final
    return GrpcChoices(dict(texts), dict(logprobs), final)


def _check_entries(entries: list[Any], expected: list[common_pb2.TokenLogprob], k: int) -> None:
    assert len(entries) == len(expected) > 0
    for entry, want in zip(entries, expected, strict=True):
        assert entry.token == want.token and entry.bytes == list(want.token.encode())
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [t.token for t in want.top] and len(want.top) == k
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([t.logprob for t in want.top], abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the most likely


def test_logprobs_equal_grpcs(api: Api) -> None:
    request = user_request(PROMPT, IMAGES[:1], max_tokens=8)
    request.sampling.logprobs = 3
    expected = grpc_choices(api, request)
    kwargs = dict(
        model=api.model,
        messages=chat(PROMPT, [data_url(IMAGES[0])]),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    completion = api.openai.chat.completions.create(**kwargs)
    assert completion.choices[0].message.content == expected.texts[0]
    _check_entries(completion.choices[0].logprobs.content, expected.logprobs[0], 3)
    assert len(expected.logprobs[0]) == expected.final.usage.completion_tokens
    chunks = list(api.openai.chat.completions.create(**kwargs, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    _check_entries(streamed, expected.logprobs[0], 3)


def _texts_by_index(choices: list[Any]) -> list[str]:
    assert sorted(c.index for c in choices) == list(range(len(choices)))
    return [c.message.content for c in sorted(choices, key=lambda c: c.index)]


def test_n_choices_with_a_seed_are_reproducible(api: Api) -> None:
    kwargs = dict(model=api.model, messages=chat("Say something."), max_tokens=8, temperature=1.0, n=3, seed=1234)
    first = api.openai.chat.completions.create(**kwargs)
    texts = _texts_by_index(first.choices)
    assert len(texts) == 3 and len(set(texts)) > 1, texts  # sampled choices differ from each other
    assert _texts_by_index(api.openai.chat.completions.create(**kwargs).choices) == texts
    streamed: dict[int, str] = defaultdict(str)
    for chunk in api.openai.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    request = user_request("Say something.", max_tokens=8, temperature=1.0, seed=1234)
    request.sampling.n, request.sampling.top_p = 3, 1.0
    expected = grpc_choices(api, request)
    assert [expected.texts.get(i, "") for i in range(3)] == texts
    assert first.usage.completion_tokens == expected.final.usage.completion_tokens
    assert first.usage.completion_tokens == sum(end.completion_tokens for end in expected.final.choices)


def test_sampling_fields_mean_what_grpcs_do(api: Api) -> None:
    """temperature, top_p, top_k, seed and stop reach the worker as the gRPC fields of the same names."""
    sampling = dict(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, top_k=20, seed=5)
    whole = api.grpc.generate(grpc_request(PROMPT, **sampling))
    assert len(whole.text) > 4, whole.text
    stop = whole.text[len(whole.text) // 2 :][:2]
    cut = api.grpc.generate(grpc_request(PROMPT, **sampling, stop=[stop]))
    assert cut.final.finish_reason == "stop" and len(cut.text) < len(whole.text)
    answer = api.openai.chat.completions.create(
        model=api.model,
        messages=chat(PROMPT),
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        top_p=0.9,
        seed=5,
        stop=stop,
        extra_body={"top_k": 20},
    )
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (cut.text, "stop")


def test_cache_salt_separates_prefix_caches(api: Api) -> None:
    body = dict(model=api.model, messages=chat("a prompt long enough to fill a few KV blocks " * 3), max_tokens=2)
    assert api.openai.chat.completions.create(**body).usage.prompt_tokens > 32
    assert api.openai.chat.completions.create(**body).usage.prompt_tokens_details.cached_tokens > 0
    salted = dict(**body, extra_body={"cache_salt": f"tenant-{time.monotonic_ns()}"})
    assert api.openai.chat.completions.create(**salted).usage.prompt_tokens_details.cached_tokens == 0
    assert api.openai.chat.completions.create(**salted).usage.prompt_tokens_details.cached_tokens > 0


def test_image_url_is_fetched_like_grpc(api: Api) -> None:
    """An http(s) image URL goes through the router's safe fetcher (loopback allowed in this test cluster only)."""
    data = IMAGES[0]
    with loopback_http.serving(data) as url:
        answer = api.openai.chat.completions.create(
            model=api.model, messages=chat(PROMPT, [url]), max_tokens=MAX_TOKENS, temperature=0
        )
    expected = api.grpc.generate(user_request(PROMPT, [data], max_tokens=MAX_TOKENS))
    assert answer.choices[0].message.content == expected.text


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_calls_with_required_and_named_choices_parse_into_the_clients_objects(api: Api) -> None:
    """`tool_choice` "required" or a named function: exactly one call, held to its schema by a grammar, in
    `message.tool_calls` and streamed `delta.tool_calls`, finish_reason "tool_calls"; the gRPC Final carries
    the same call; "auto" is served, "none" leaves the tools out, and the call and its result go back into the
    conversation (an agent's next turn)."""
    base = dict(model=api.model, messages=chat("What is the weather in Paris?"), max_tokens=96, temperature=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names in [("required", {"get_weather", "get_time"}), (named, {"get_weather"})]:
        answer = api.openai.chat.completions.create(**base, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)
        made = answer.choices[0]
        assert made.finish_reason == "tool_calls" and made.message.content is None, made
        (call,) = made.message.tool_calls
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(arguments) == {"city"} and len(arguments["city"]) <= 10
        streamed, finish = {}, None
        for chunk in api.openai.chat.completions.create(
            **base, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, stream=True
        ):
            for delta_choice in chunk.choices:
                assert not delta_choice.delta.content
                for delta in delta_choice.delta.tool_calls or []:
                    streamed[delta.index] = (delta.function.name, delta.function.arguments)
                finish = delta_choice.finish_reason or finish
        assert finish == "tool_calls" and streamed == {0: (call.function.name, call.function.arguments)}
    request = user_request("What is the weather in Paris?", max_tokens=96)
    request.tools.add(name="get_weather", parameters=json.dumps(WEATHER_TOOL["function"]["parameters"]))
    request.tool_choice.mode = "required"
    answered = grpc_choices(api, request)
    (end,) = answered.final.choices
    assert end.finish_reason == "tool_calls" and [c.name for c in end.tool_calls] == ["get_weather"]
    assert set(json.loads(end.tool_calls[0].arguments)) == {"city"}
    assert answered.texts[0].startswith("<tool_call>\n") and answered.texts[0].endswith("\n</tool_call>")
    short = base | {"max_tokens": 8}
    auto = api.openai.chat.completions.create(**short, tools=[WEATHER_TOOL], tool_choice="auto")
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = api.openai.chat.completions.create(**short)
    none = api.openai.chat.completions.create(**short, tools=[WEATHER_TOOL], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    error = error_body(api.post("/v1/chat/completions", {"messages": chat("hi"), "tool_choice": "required"}))
    assert "tool_choice required needs tools" in error["message"]
    turns = [
        *base["messages"],
        made.message.model_dump(exclude_none=True),  # the assistant's call, as the client got it
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22C"},
    ]
    after = api.openai.chat.completions.create(**base | {"messages": turns, "max_tokens": 8}, tools=[WEATHER_TOOL])
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens > auto.usage.prompt_tokens  # the call and its result are in the prompt


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=10)


def test_the_clients_pydantic_tools_parse_into_typed_arguments_streamed_and_not(api: Api) -> None:
    """The official client's own strict tool (`openai.pydantic_function_tool`) under `tool_choice` "required" and
    named: `chat.completions.parse` and `chat.completions.stream` both give the call's arguments as the
    client's typed object (`parsed_arguments`, a `GetWeather`), the same streamed and not."""
    tool = openai.pydantic_function_tool(GetWeather)
    base = dict(model=api.model, messages=chat("What is the weather in Paris?"), max_tokens=96, temperature=0)
    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        whole = api.openai.chat.completions.parse(**base, tools=[tool], tool_choice=choice)
        assert whole.choices[0].finish_reason == "tool_calls", whole
        (call,) = whole.choices[0].message.tool_calls
        assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
        with api.openai.chat.completions.stream(**base, tools=[tool], tool_choice=choice) as stream:
            streamed = stream.get_final_completion()
        (again,) = streamed.choices[0].message.tool_calls
        assert again.function.parsed_arguments == call.function.parsed_arguments
        assert streamed.choices[0].finish_reason == "tool_calls"


def test_sixteen_concurrent_constrained_requests_equal_generate_with_xgrammar(api: Api) -> None:
    """16 requests at once through the cluster (so they share batches): every kind of constraint, plain ones,
    and images among both; each answer's tokens equal transformers' `generate` with xgrammar's processor for
    the same constraint, and each that ended "stop" parses and validates."""
    tokenizer = AutoTokenizer.from_pretrained(api.model_dir)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, len(tokenizer), eos), cache_enabled=False)
    kinds = [*CONSTRAINTS, None, None]
    cases = []
    for i in range(16):
        name = kinds[i % len(kinds)]
        images = [media_factory.png(56 + 4 * i, 56, seed=700 + i)] if i % 3 == 0 else []
        request = user_request(f"answer number {i} in the format asked", images, max_tokens=40, cache_salt="xg")
        if name is not None:
            set_structured(request.sampling, CONSTRAINTS[name])
        cases.append((name, images, request))

    def tokens(request: generation_pb2.GenerateRequest) -> tuple[list[int], str]:
        ids, reason = [], ""
        for response in api.grpc.stream(request):
            if response.HasField("chunk"):
                ids.extend(response.chunk.token_ids)
            else:
                reason = response.final.finish_reason
        return ids, reason

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(tokens, [request for _, _, request in cases]))
    stopped = 0
    for (name, images, request), (ids, reason) in zip(cases, answers, strict=True):
        parts = [ChatPart("image") for _ in images] + [ChatPart("text", request.messages[0].content[-1].text)]
        decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        opts = SamplingOptions(max_tokens=40, structured=CONSTRAINTS[name] if name else None)
        expected = oracle(api.model_dir, [ChatMessage("user", parts)], decoded, opts, compiler, eos, name is not None)
        assert ids == expected, (name, tokenizer.decode(ids), tokenizer.decode(expected))
        if name is not None and reason == "stop":
            stopped += 1
            check_valid(name, CONSTRAINTS[name], tokenizer.decode(ids[:-1]))
    assert stopped >= 8
