"""Structured-output constraints without an engine: the limits and what they refuse (regexes whose matcher
state grows with every token, schemas too deep or using what xgrammar ignores), the library's messages without
its source locations, the compiled-grammar cache (one compile per constraint, bounded in count and bytes,
refusals remembered), and the router's check (whitespace resolved, a compile past its time bound refused and
then served from the cache)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from transformers import AutoTokenizer

from services.common.grammar import (
    Constraint,
    ConstraintError,
    GrammarLimits,
    check_constraint,
    check_regex,
    check_schema_document,
    constraint_of,
    grammar_of,
)
from services.common.grammar_cache import GrammarCache, tokenizer_info
from services.common.rpc.epd.v1 import common_pb2
from services.router.config import RouterConfig
from services.router.errors import RequestError
from services.router.structured import StructuredCheck

SAFE = ["(ab)*", "[(*]+", "a{2,}", "(a{2,5})*", "(a|b)+c", r"\(a*\)*", "a*?", "(a*)?b", "(ab?)*", r"\d{3}-\d{4}"]
SAFE += ["(yes|no)!", "((a)*)", "(^a)+", "((a?)b)+", "(a{1,9}){1,9}", "(a|aa|aaa)*"]
NESTED = ["(a*)*b", "(x*x*)*y", r"(\w+\s)*", "((ab)*c)*", "(a*){50}", "(a+){2,5}b", "(?:a*)*", "(a(b*)?)*"]
NULLABLE = ["(a?a?a?)+b", "(a?)+b", "(a|)*", "(|a)+", "(a?){30}"]
STACKED = ["a*{2,}", "a**", "a*+", "a{0,}{0,}", "a{2}{3}"]


def test_regexes_whose_matching_cost_grows_are_refused_and_others_pass() -> None:
    for pattern in SAFE:
        check_regex(pattern, 64)
    for pattern in NESTED + NULLABLE:
        with pytest.raises(ConstraintError, match="repeats a group that repeats without bound or can match nothing"):
            check_regex(pattern, 64)
    for pattern in STACKED:
        with pytest.raises(ConstraintError, match="stacks two repetitions"):
            check_regex(pattern, 64)
    with pytest.raises(ConstraintError, match="nests groups deeper than this server's limit of 4"):
        check_regex("(((((a)))))", 4)


def _deep(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_schemas_are_walked_without_recursion_and_ignored_features_refused() -> None:
    check_schema_document(_deep(20), 64)
    with pytest.raises(ConstraintError, match="nested deeper than this server's limit of 64"):
        check_schema_document(_deep(10_000), 64)
    text = '{"items": ' * 10_000 + "{}" + "}" * 10_000  # past json's own recursion limit
    with pytest.raises(ConstraintError, match="nested deeper"):
        check_constraint(Constraint("json_schema", text), GrammarLimits())
    named = {"type": "object", "properties": {"format": {"type": "string"}, "maxProperties": {"type": "integer"}}}
    check_schema_document({**named, "enum": [{"format": "x-none"}], "default": {"propertyNames": 1}}, 64)
    for schema, said in [
        ({"type": "string", "format": "credit-card"}, "format 'credit-card' is not supported"),
        ({"properties": {"a": {"type": "object", "maxProperties": 2}}}, "at /properties/a: maxProperties"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames is not supported"),
        ({"properties": {"a": {"type": "string", "pattern": "(a+)+"}}}, "at /properties/a: pattern repeats"),
        ([1, 2], "must be a JSON object"),
    ]:
        with pytest.raises(ConstraintError, match=said):
            check_schema_document(schema, 64)
    check_schema_document({"type": "string", "format": "date-time"}, 64)


def test_limits_and_the_librarys_messages() -> None:
    limits = GrammarLimits(max_bytes=100, max_depth=8)
    with pytest.raises(ConstraintError, match="grammar is 101 bytes, above this server's limit of 100"):
        check_constraint(Constraint("grammar", "x" * 101), limits)
    with pytest.raises(ConstraintError, match="choice needs at least one choice"):
        check_constraint(Constraint("choice", json.dumps(["a", ""])), limits)
    with pytest.raises(ConstraintError) as info:
        grammar_of(Constraint("json_schema", '{"type": "strin"}'))
    assert str(info.value) == 'json_schema does not compile: Unsupported type "strin"'
    with pytest.raises(
        ConstraintError, match=r"^regex does not compile: Regex parsing error at position 3: Unclosed '\['$"
    ):
        grammar_of(Constraint("regex", "[a"))
    assert 'root ::= (("a\\"b") | ("c\\\\d"))' in str(grammar_of(Constraint("choice", json.dumps(['a"b', "c\\d"]))))
    bounded = str(grammar_of(Constraint("json_schema", '{"type": "string", "maxLength": 3}')))
    assert r"[^\0-\x1f\"\\]" in bounded  # no control character in a length-bounded string


def test_the_protos_oneof_is_read_once() -> None:
    assert constraint_of(common_pb2.SamplingParams()) is None
    assert constraint_of(common_pb2.SamplingParams(json_object=False)) is None
    sampling = common_pb2.SamplingParams(json_schema='{"type": "integer"}')
    assert constraint_of(sampling, any_whitespace=True) == Constraint("json_schema", '{"type": "integer"}', True)
    sampling.any_whitespace = False
    assert constraint_of(sampling, any_whitespace=True).any_whitespace is False
    regex = constraint_of(common_pb2.SamplingParams(regex="a+", any_whitespace=True))
    assert regex == Constraint("regex", "a+")  # whitespace is a JSON matter: the key does not change
    choice = constraint_of(common_pb2.SamplingParams(choice=common_pb2.Choices(choices=["é", "b"])))
    assert choice == Constraint("choice", '["é", "b"]')
    assert len({Constraint("regex", "a").key, Constraint("grammar", "a").key, Constraint("regex", "b").key}) == 3


@pytest.fixture(scope="module")
def info(tiny_model_dir: Path) -> object:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tokenizer_info(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_the_cache_compiles_once_and_is_bounded(info: object) -> None:
    cache = GrammarCache(lambda: info, max_entries=2, max_bytes=1 << 30)
    a, b, c = (Constraint("regex", f"{x}{{3}}") for x in "abc")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = list(pool.map(lambda _: cache.compile(a), range(8)))
    assert len({id(f.result()) for f in futures}) == 1 and cache.compiles == 1
    cache.compile(b).result()
    assert cache.get(a.key) is not None  # a is now the most recent: c evicts b
    cache.compile(c).result()
    assert cache.get(b.key) is None and len(cache) == 2 and cache.compiles == 3
    assert cache.bytes == sum(cache.get(x.key).memory_size_bytes for x in (a, c))
    bad = Constraint("regex", "(?=a)")
    for _ in range(3):
        with pytest.raises(ConstraintError, match="Lookahead is not supported"):
            cache.compile(bad).result()
    assert cache.compiles == 4  # the refusal is remembered
    small = GrammarCache(lambda: info, max_entries=8, max_bytes=1)
    assert small.compile(a).result() is not None and len(small) == 0 and small.bytes == 0
    cache.close()
    small.close()


def test_the_routers_check_resolves_whitespace_and_bounds_the_compile(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    adapter = SimpleNamespace(tokenizer=tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    config = RouterConfig(structured_any_whitespace=True, structured_compile_timeout_s=1e-6)
    check = StructuredCheck(SimpleNamespace(adapter=adapter), config)
    schema = common_pb2.SamplingParams(json_schema='{"type": "array", "items": {"type": "integer"}}')
    check.resolve(schema)
    assert schema.HasField("any_whitespace") and schema.any_whitespace
    regex = common_pb2.SamplingParams(regex="a+")
    check.resolve(regex)
    assert not regex.HasField("any_whitespace")
    with pytest.raises(RequestError) as info:
        asyncio.run(check.compile(schema))  # a microsecond is too short for any compile
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("sampling.json_schema takes longer than this server's 1e-06 s")
    constraint = constraint_of(schema)
    check.cache.compile(constraint).result()  # the compile went on and was kept
    asyncio.run(check.compile(schema))  # now answered from the cache
    with pytest.raises(RequestError, match=r"^sampling.regex stacks two repetitions"):
        check.resolve(common_pb2.SamplingParams(regex="a**"))
    check.close()
