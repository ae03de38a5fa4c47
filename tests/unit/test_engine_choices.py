"""Requests of n choices and logprobs on the tiny model: later choices share choice 0's prompt blocks, seeded
choices reproduce anywhere, reservations for n stay within the limit and aborts return everything; logprobs are
`generate`'s raw log-softmax."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.kv_blocks import request_blocks, shared_prompt_blocks
from services.worker.engine.attention.kv_cache import KVShape
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingOptions, StepOutput
from tests.engine_support import Prompt, Result, build_prompt, image, reference
from tests.oracle import hf_generate_logits

LONG = "a long shared system preamble about many things that every request starts with " * 3
Choice = tuple[str, int]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(loaded: tuple[Any, Any], **overrides: Any) -> Engine:
    adapter, model = loaded
    settings = {"kv_cache_bytes": 8 << 20, "max_num_batched_tokens": 64, "max_num_seqs": 16, **overrides}
    return Engine(adapter, model, EngineConfig(**settings))


def collect(outputs: list[StepOutput], results: dict[Choice, Result]) -> None:
    """Outputs per (request id, choice); a request's last output finishes its last choice."""
    for out in outputs:
        result = results.setdefault((out.request_id, out.index), Result())
        assert result.finish_reason is None, f"output after {out.request_id}/{out.index} finished"
        result.tokens.extend(out.new_token_ids)
        result.cached_tokens = out.cached_tokens
        if out.finished:
            result.finish_reason = out.finish_reason
        if out.request_finished:
            assert out.finished
            assert all(r.finish_reason for (rid, _), r in results.items() if rid == out.request_id)


def drain(engine: Engine, results: dict[Choice, Result]) -> None:
    for _ in range(100_000):
        if not engine.has_work():
            return
        collect(engine.step(), results)
    raise AssertionError("engine did not finish")


def provide(engine: Engine, prompt: Prompt) -> None:
    for mm_hash, tensor in prompt.embeddings.items():
        engine.provide_embedding(mm_hash, tensor)


def assert_all_returned(engine: Engine) -> None:
    state = engine.kv_state()
    assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0, state
    assert state.running == 0 and state.waiting == 0 and state.preemptions == 0
    assert not engine.requests and not engine.scheduler.ledger.need
    assert engine.embedding_stats().pinned == 0 and not engine.embeddings.refs


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_choices_share_the_prompt_and_equal_generate(
    loaded: tuple[Any, Any], tiny_model_dir: Path, caching: bool
) -> None:
    adapter, model = loaded
    prompt = build_prompt(adapter, model, [LONG, image(224, 224, 71), "what is shown here?"])
    engine = make_engine(loaded, enable_prefix_caching=caching, max_num_batched_tokens=48)
    provide(engine, prompt)
    engine.add_request(prompt.request("g", SamplingOptions(max_tokens=10, n=3)))
    assert [s.name for s in engine.requests["g"]] == ["g", "g/1", "g/2"]
    results: dict[Choice, Result] = {}
    drain(engine, results)
    expected = reference(tiny_model_dir, prompt, 10)
    assert [results["g", i].tokens for i in range(3)] == [expected] * 3
    assert shared_prompt_blocks(len(prompt.token_ids), 16) > 0
    # the later choices start once choice 0 computed the prompt: its full blocks hit, its last block is copied
    cached = len(prompt.token_ids) - 1 if caching else 0
    assert [results["g", i].cached_tokens for i in range(3)] == [0, cached, cached]
    assert_all_returned(engine)


def test_seeded_choices_are_the_same_alone_in_a_crowd_and_as_single_requests(loaded: tuple[Any, Any]) -> None:
    """Choice i of a seeded request draws from seed + i: the same tokens alone, among 12 other requests (some of
    several choices, some unseeded) on an engine with another budget, and as a one-choice request of seed + i."""
    adapter, model = loaded
    target = build_prompt(adapter, model, ["tell me a story about", image(120, 90, 72), "this picture"])
    seeded = SamplingOptions(max_tokens=16, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True, n=3)
    alone = make_engine(loaded)
    provide(alone, target)
    alone.add_request(target.request("t", seeded))
    alone_results: dict[Choice, Result] = {}
    drain(alone, alone_results)
    answers = [alone_results["t", i].tokens for i in range(3)]
    assert all(len(tokens) == 16 for tokens in answers) and len({tuple(t) for t in answers}) == 3

    crowd = make_engine(loaded, max_num_batched_tokens=32, max_num_seqs=8)
    provide(crowd, target)
    crowd_results: dict[Choice, Result] = {}
    for i in range(12):
        other = build_prompt(adapter, model, [f"other prompt {i} " * (i + 1)])
        sampling = SamplingOptions(max_tokens=12, temperature=0.8 * (i % 2), seed=i if i % 3 else None, n=1 + i % 3)
        crowd.add_request(other.request(f"o{i}", sampling))
        if i == 5:
            crowd.add_request(target.request("t", seeded))
        collect(crowd.step(), crowd_results)
    drain(crowd, crowd_results)
    assert [crowd_results["t", i].tokens for i in range(3)] == answers
    assert_all_returned(crowd)

    single = make_engine(loaded)
    provide(single, target)
    for i in range(3):
        single.add_request(target.request(f"s{i}", SamplingOptions(**{**_fields(seeded), "seed": 77 + i, "n": 1})))
    single_results: dict[Choice, Result] = {}
    drain(single, single_results)
    assert [single_results[f"s{i}", 0].tokens for i in range(3)] == answers


def _fields(options: SamplingOptions) -> dict[str, Any]:
    return {name: getattr(options, name) for name in SamplingOptions.__dataclass_fields__}


def test_logprobs_are_generates_raw_log_softmax(loaded: tuple[Any, Any], tiny_model_dir: Path) -> None:
    """Greedy with logprobs=5: tokens equal `generate`, each token's logprob and its top 5 equal the log-softmax
    of `generate`'s raw logits at that position (to float32 rounding of a different attention path); a sampled
    request gets its drawn token's logprob, which need not be the top one."""
    adapter, model = loaded
    prompt = build_prompt(adapter, model, ["look", image(112, 84, 73), "and describe it"])
    engine = make_engine(loaded)
    provide(engine, prompt)
    engine.add_request(prompt.request("lp", SamplingOptions(max_tokens=8, logprobs=5)))
    hot = SamplingOptions(max_tokens=8, temperature=1.5, seed=3, logprobs=2, ignore_eos=True, n=2)
    engine.add_request(prompt.request("hot", hot))
    logprobs: dict[Choice, list] = {}
    results: dict[Choice, Result] = {}
    for _ in range(1000):
        if not engine.has_work():
            break
        outputs = engine.step()
        for out in outputs:
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            logprobs.setdefault((out.request_id, out.index), []).extend(out.logprobs)
        collect(outputs, results)
    tokens, logits = hf_generate_logits(tiny_model_dir, prompt.messages, prompt.images, 8)
    assert results["lp", 0].tokens == tokens
    expected = torch.log_softmax(logits, dim=-1)
    for position, (token, got) in enumerate(zip(tokens, logprobs["lp", 0], strict=True)):
        values, ids = expected[position].topk(5)
        assert got.logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
        assert got.logprob == max(got.top_logprobs) and got.top_ids[0] == token
        assert got.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)
        gaps = (values[:-1] - values[1:]).tolist()
        assert [i for i, gap in zip(got.top_ids, gaps, strict=False) if gap > 1e-3] == [
            i for i, gap in zip(ids.tolist(), gaps, strict=False) if gap > 1e-3
        ]
    drawn = [lp for i in range(2) for lp in logprobs["hot", i]]
    assert all(len(lp.top_ids) == 2 and lp.logprob <= lp.top_logprobs[0] + 1e-6 for lp in drawn)
    assert any(lp.logprob < lp.top_logprobs[0] for lp in drawn)  # at temperature 1.5 some draw is not the argmax
    assert_all_returned(engine)


def test_n_choice_reservations_stay_within_the_limit(loaded: tuple[Any, Any]) -> None:
    """A small KV (40 blocks), requests of 1-4 choices admitted as the worker admits them (``Engine.admit``: all
    choices or none), retried when refused: the reserved blocks never pass the total, nothing is preempted, each
    admission reserved exactly ``request_blocks``, and everything returns at the end."""
    adapter, model = loaded
    rng = random.Random(5)
    block_bytes = KVShape.of(model).block_bytes(16, torch.float32)
    engine = make_engine(loaded, kv_cache_bytes=40 * block_bytes, max_num_batched_tokens=48, max_num_seqs=8)
    pending, choices = [], []
    for i in range(14):
        text = "shared words " * rng.randint(2, 12) + f"request {i}"
        prompt = build_prompt(adapter, model, [text])
        sampling = SamplingOptions(
            max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 1.0]), n=rng.randint(1, 4)
        )
        pending.append(prompt.request(f"r{i}", sampling))
        choices.append(sampling.n)
    results: dict[Choice, Result] = {}
    refused = 0
    for _ in range(20_000):
        while pending:
            request = pending[0]
            before = engine.kv_state().reserved_blocks
            if not engine.admit(request):
                refused += 1
                assert engine.kv_state().reserved_blocks == before and request.request_id not in engine.requests
                break
            sampling = request.sampling
            need = request_blocks(len(request.token_ids), sampling.max_tokens, sampling.n, 16)
            assert engine.kv_state().reserved_blocks - before == need
            pending.pop(0)
        if not pending and not engine.has_work():
            break
        collect(engine.step(), results)
        state = engine.kv_state()
        assert state.reserved_blocks <= state.total_blocks and state.preemptions == 0
    assert refused > 0 and not pending  # the KV was full at times
    assert sorted(results) == sorted((f"r{i}", c) for i, n in enumerate(choices) for c in range(n))
    assert all(r.finish_reason in ("stop", "length") for r in results.values())
    assert_all_returned(engine)


def test_abort_of_a_request_returns_all_its_choices(loaded: tuple[Any, Any]) -> None:
    """Requests of 1-3 choices with images, embeddings late, aborted at random points (before and after their
    later choices started): blocks, reservations and embedding references all return; no output follows."""
    adapter, model = loaded
    rng = random.Random(9)
    pictures = [image(112, 112, 80 + i) for i in range(3)]
    prompts = [
        build_prompt(adapter, model, [LONG if i % 2 else f"question {i}", pictures[i % 3], "what is it?"])
        for i in range(12)
    ]
    engine = make_engine(loaded, max_num_batched_tokens=40, max_num_seqs=10)
    for i, prompt in enumerate(prompts):
        sampling = SamplingOptions(max_tokens=rng.randint(4, 16), temperature=0.7, seed=i, ignore_eos=True, n=1 + i % 3)
        engine.add_request(prompt.request(f"r{i}", sampling))
    abort_at = {i: rng.randint(0, 30) for i in rng.sample(range(12), 7)}
    aborted: set[str] = set()
    results: dict[Choice, Result] = {}
    for step in range(10_000):
        if step in (2, 9):
            for prompt in prompts[step % 2 :: 2]:
                provide(engine, prompt)
        for i in [i for i, at in abort_at.items() if at == step]:
            live = f"r{i}" in engine.requests
            assert engine.abort(f"r{i}") == live and not engine.abort(f"r{i}") and f"r{i}" not in engine.requests
            aborted.add(f"r{i}")
        if step > 30 and not engine.has_work():
            break
        outputs = engine.step()
        assert not [out for out in outputs if out.request_id in aborted]
        collect(outputs, results)
    for i in range(12):
        if f"r{i}" not in aborted:
            assert all(results[f"r{i}", c].finish_reason == "length" for c in range(1 + i % 3))
    assert_all_returned(engine)


def test_request_ids_that_look_like_choices_stay_apart(loaded: tuple[Any, Any]) -> None:
    """A request named "x/1" next to request "x" of two choices (whose choice 1 reads "x/1"): reservations
    are keyed by (request id, choice), so neither replaces the other's."""
    adapter, model = loaded
    prompt = build_prompt(adapter, model, [LONG])
    engine = make_engine(loaded)
    assert engine.admit(prompt.request("x", SamplingOptions(max_tokens=6, n=2, ignore_eos=True)))
    need = request_blocks(len(prompt.token_ids), 6, 2, 16)
    assert engine.kv_state().reserved_blocks == need
    assert engine.admit(prompt.request("x/1", SamplingOptions(max_tokens=4, ignore_eos=True)))
    assert engine.kv_state().reserved_blocks == need + request_blocks(len(prompt.token_ids), 4, 1, 16)
    results: dict[Choice, Result] = {}
    drain(engine, results)
    assert {key: len(r.tokens) for key, r in results.items()} == {("x", 0): 6, ("x", 1): 6, ("x/1", 0): 4}
    assert_all_returned(engine)
