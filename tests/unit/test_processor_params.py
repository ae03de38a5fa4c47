"""The router's checks of the logits-processor sampling fields (INVALID_ARGUMENT naming the field and its
bound, NaN and infinities refused), bad words tokenized as vLLM does, the worker's mapping of the fields into
the engine's options, and a stop token's text left out of the streamed text."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.rpc.epd.v1 import common_pb2, worker_pb2
from services.models.registry import load_adapter
from services.router.errors import RequestError
from services.router.output import Choices, TokenTexts
from services.router.processor_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, bad_word_ids, check_processor_params
from services.worker.messages import engine_request


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path) -> Any:
    return load_adapter(tiny_model_dir)


def _checked(adapter: Any, **fields: Any) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(max_tokens=16, **fields)
    check_processor_params(sampling, adapter.tokenizer, adapter.vocab_size)
    return sampling


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"repetition_penalty": -1.0}, r"sampling.repetition_penalty must be > 0 and finite .*-1"),
        ({"repetition_penalty": math.nan}, r"sampling.repetition_penalty .* got nan"),
        ({"repetition_penalty": math.inf}, r"sampling.repetition_penalty .* got inf"),
        ({"presence_penalty": 2.5}, r"sampling.presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"presence_penalty": math.nan}, r"sampling.presence_penalty must be in \[-2, 2\], got nan"),
        ({"frequency_penalty": -math.inf}, r"sampling.frequency_penalty must be in \[-2, 2\], got -inf"),
        ({"min_p": 1.5}, r"sampling.min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": math.nan}, r"sampling.min_p must be in \[0, 1\], got nan"),
        ({"min_tokens": 17}, r"sampling.min_tokens 17 is above max_tokens 16"),
        ({"stop_token_ids": [3, 562]}, r"sampling.stop_token_ids: token id 562 is outside the model's vocabulary"),
        ({"stop_token_ids": list(range(129))}, r"sampling.stop_token_ids: at most 128 ids"),
        ({"logit_bias": {562: 1.0}}, r"sampling.logit_bias: token id 562 is outside"),
        ({"logit_bias": {5: 100.5}}, r"sampling.logit_bias\[5\] must be in \[-100, 100\], got 100.5"),
        ({"logit_bias": {5: math.nan}}, r"sampling.logit_bias\[5\] must be in \[-100, 100\], got nan"),
        ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)}, r"sampling.logit_bias: at most 1024 entries"),
        ({"bad_words": ["  "]}, r"sampling.bad_words\[0\] is empty"),
        ({"bad_words": ["x"] * (MAX_BAD_WORDS + 1)}, r"sampling.bad_words: at most 128 words"),
        ({"bad_words": ["x" * 257]}, r"of at most 256 characters"),
        ({"bad_words_token_ids": [common_pb2.TokenIds()]}, r"sampling.bad_words_token_ids\[0\] is empty"),
        ({"bad_words_token_ids": [common_pb2.TokenIds(ids=[1, 600])]}, r"bad_words_token_ids\[0\]: token id 600"),
    ],
)
def test_values_out_of_bounds_are_invalid_argument_naming_the_field(adapter: Any, fields: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        _checked(adapter, **fields)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_defaults_and_values_within_bounds_pass(adapter: Any) -> None:
    assert _checked(adapter) == common_pb2.SamplingParams(max_tokens=16)
    fields = {"repetition_penalty": 1.3, "presence_penalty": -2.0, "frequency_penalty": 2.0, "min_p": 1.0,
              "min_tokens": 16, "stop_token_ids": [561], "logit_bias": {0: -100.0, 561: 100.0}}  # fmt: skip
    assert _checked(adapter, **fields) == common_pb2.SamplingParams(max_tokens=16, **fields)


def test_bad_words_become_token_ids_as_vllm_tokenizes_them(adapter: Any) -> None:
    """Each word as tokenized alone and, when that is another first token of the same length, after a space
    (the word inside a text); a client's own sequences come first, kept."""
    tokenizer = adapter.tokenizer
    hello = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert hello[0] != spaced[0] and len(hello) == len(spaced)
    assert bad_word_ids(tokenizer, "  hello") == [hello, spaced]
    picture = tokenizer.encode("the picture", add_special_tokens=False)
    assert len(tokenizer.encode(" the picture", add_special_tokens=False)) != len(picture)
    assert bad_word_ids(tokenizer, "the picture") == [picture]
    own = common_pb2.TokenIds(ids=[7, 8])
    sampling = _checked(adapter, bad_words=["hello", "the picture"], bad_words_token_ids=[own])
    assert [list(w.ids) for w in sampling.bad_words_token_ids] == [[7, 8], hello, spaced, picture]


def test_the_worker_maps_every_field_into_the_engines_options() -> None:
    sampling = common_pb2.SamplingParams(
        max_tokens=8, repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.75, min_p=0.5,
        min_tokens=3, stop_token_ids=[4, 2], logit_bias={9: 1.5, 3: -2.0},
        bad_words_token_ids=[common_pb2.TokenIds(ids=[5]), common_pb2.TokenIds(ids=[6, 7])],
    )  # fmt: skip
    opts = engine_request(worker_pb2.WorkerRequest(request_id="r", token_ids=[1], sampling=sampling)).sampling
    assert (opts.repetition_penalty, opts.presence_penalty, opts.frequency_penalty) == (1.25, 0.5, -0.75)
    assert opts.min_p == 0.5
    assert opts.min_tokens == 3 and opts.stop_token_ids == (4, 2) and opts.bad_words == ((5,), (6, 7))
    assert opts.logit_bias == ((3, -2.0), (9, 1.5))
    unset = engine_request(worker_pb2.WorkerRequest(request_id="r", token_ids=[1], sampling={"max_tokens": 8}))
    assert unset.sampling.repetition_penalty == 1.0 and not unset.sampling.processes_logits


def test_the_stop_token_is_in_the_token_ids_not_in_the_text(adapter: Any) -> None:
    """As vLLM: a choice that ends on a stop id (or eos) streams that id but not its text."""
    tokenizer = adapter.tokenizer
    words = tokenizer.encode("the cat sat", add_special_tokens=False)
    choices = Choices(tokenizer, [], 2, TokenTexts(tokenizer))
    stopped = choices.chunk(worker_pb2.WorkerResponse(token_ids=words, finished=True, finish_reason="stop")).chunk
    assert list(stopped.token_ids) == words and stopped.text == tokenizer.decode(words[:-1])
    length = choices.chunk(
        worker_pb2.WorkerResponse(token_ids=words, index=1, finished=True, finish_reason="length")
    ).chunk
    assert length.text == tokenizer.decode(words)


def test_the_http_fields_map_onto_the_grpc_ones_and_are_checked_the_same() -> None:
    """Chat and text completions carry the penalties, logit_bias (token ids as strings) and vLLM's extras into
    `SamplingParams`; null is unset; a key that is no token id, or a bias past the router's bound, is a 400
    naming the field (the router's message in the HTTP field's name)."""
    import json

    from services.router.http_errors import HttpError, from_request_error
    from services.router.http_exchange import parse
    from services.router.openai_request import (
        ChatCompletionRequest,
        CompletionRequest,
        completion_request,
        generate_request,
    )

    fields = {"repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.25,
              "min_tokens": 2, "stop_token_ids": [7, 9], "bad_words": ["cat"],
              "logit_bias": {"5": 2.5, "11": -100}}  # fmt: skip
    user = [{"role": "user", "content": "hi"}]
    expected = common_pb2.SamplingParams(
        repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.5, min_p=0.25, min_tokens=2,
        stop_token_ids=[7, 9], bad_words=["cat"], logit_bias={5: 2.5, 11: -100.0},
    )  # fmt: skip
    chat = generate_request(parse(ChatCompletionRequest, json.dumps({"messages": user, **fields}).encode()), "r")
    text = completion_request(parse(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode()), "r")
    for sampling in (chat.sampling, text.sampling):
        got = common_pb2.SamplingParams()
        got.CopyFrom(sampling)
        for name in ("max_tokens", "temperature", "top_p", "n"):
            got.ClearField(name)
        assert got == expected
    nulls = generate_request(parse(ChatCompletionRequest, json.dumps({"messages": user, **dict.fromkeys(fields)})), "r")
    assert nulls.sampling == common_pb2.SamplingParams(temperature=1.0, top_p=1.0, n=1)
    for bad in ({"logit_bias": {"x": 1.0}}, {"logit_bias": {"-3": 1.0}}, {"stop_token_ids": [-1]}, {"min_p": "NaN"}):
        with pytest.raises(HttpError) as info:
            parse(ChatCompletionRequest, json.dumps({"messages": user, **bad}).encode())
        assert info.value.status == 400 and info.value.param.startswith(next(iter(bad))), info.value.message
    error = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias[5] must be in [-100, 100], got 101.0")
    answer = from_request_error(error, ChatCompletionRequest.model_validate({"messages": user}).field_names())
    assert (answer.status, answer.param) == (400, "logit_bias")
    assert answer.message == "logit_bias[5] must be in [-100, 100], got 101.0"
