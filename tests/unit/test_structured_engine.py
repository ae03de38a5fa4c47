"""Structured outputs in the engine equal transformers' `generate` run with xgrammar's own logits processor
(`xgrammar.contrib.hf.LogitsProcessor`) for the same constraint, on the tiny model: JSON schemas (enums,
maxLength, maxItems, nested objects, a bounded integer), any JSON object, regexes, choices and an EBNF grammar,
greedy and seeded, 37 constrained requests mixed in the same batches with plain and image requests and a request
of two choices; outputs that
ended "stop" parse and validate against their constraint, one that cannot finish ends "length"; logprobs stay
the raw distribution's; a continuation (a migrated request) rebuilds its matcher from the tokens generated
before; a constraint that does not compile ends its request "error" holding nothing, and a second request
with it is refused at admission. The greedy batch runs again under an inter-token latency target and decode
priority (prefills cut into small chunks beside the constrained decodes): the same tokens."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

from services.common.grammar import Constraint, grammar_of
from services.common.grammar_cache import tokenizer_info
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.host_device import HostDevice
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.step_mask import StepMask
from services.worker.engine.structured import REFUSED, STOPPED, StructuredOutputs
from tests.engine_support import Prompt, Result, build_prompt, image
from tests.structured_support import CONSTRAINTS, check_valid, oracle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 48


def _engine(loaded: tuple[Any, Any], **settings: Any) -> Engine:
    adapter, model = loaded
    config = EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=96, max_num_seqs=32, **settings)
    return Engine(adapter, model, config)


def _run(
    engine: Engine, requests: list[tuple[Prompt, EngineRequest]], steps: list[int] | None = None
) -> dict[str, Result]:
    """All ``requests`` queued at once, run to the end; results by request id ("<id>/<i>" for a later choice);
    the number of steps taken is appended to ``steps`` when given."""
    for prompt, request in requests:
        for mm_hash, tensor in prompt.embeddings.items():
            engine.provide_embedding(mm_hash, tensor)
        engine.add_request(request)
    results: dict[str, Result] = {}
    for taken in range(10_000):
        if not engine.has_work():
            if steps is not None:
                steps.append(taken)
            break
        for out in engine.step():
            key = out.request_id if out.index == 0 else f"{out.request_id}/{out.index}"
            result = results.setdefault(key, Result())
            result.tokens.extend(out.new_token_ids)
            if out.finished:
                result.finish_reason = out.finish_reason
    assert not engine.requests and engine.scheduler.ledger.reserved_blocks == 0
    return results


@pytest.fixture(scope="module")
def prompts(loaded: tuple[Any, Any]) -> list[Prompt]:
    adapter, model = loaded
    return [
        build_prompt(adapter, model, ["give me the answer as json"]),
        build_prompt(adapter, model, ["describe", image(64, 48, 41), "in a few words"]),
        build_prompt(adapter, model, ["fill in the form from", image(40, 56, 42)]),
        build_prompt(adapter, model, ["list the colours you see, one field each"]),
    ]


@pytest.fixture(scope="module")
def compiler(loaded: tuple[Any, Any]) -> Any:
    adapter, model = loaded
    vocab = model.get_output_embeddings().weight.shape[0]
    return xgr.GrammarCompiler(tokenizer_info(adapter.tokenizer, vocab, adapter.eos_token_ids), cache_enabled=False)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_constrained_outputs_equal_generate_with_xgrammar_and_validate(
    loaded: tuple[Any, Any], tiny_model_dir: Path, prompts: list[Prompt], compiler: Any, seeded: bool
) -> None:
    adapter, _ = loaded
    eos = list(adapter.eos_token_ids)
    base = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.9, top_k=40, seed=3) if seeded else None
    base = base or SamplingOptions(max_tokens=MAX_TOKENS)
    requests, expected = [], {}
    for i, prompt in enumerate(prompts):
        plain = prompt.request(f"plain{i}", base)
        requests.append((prompt, plain))
        expected[plain.request_id] = oracle(
            tiny_model_dir, prompt.messages, prompt.images, base, compiler, eos, constrained=False
        )
        for name, constraint in CONSTRAINTS.items():
            opts = dataclasses.replace(base, structured=constraint)
            requests.append((prompt, prompt.request(f"{name}{i}", opts)))
            expected[f"{name}{i}"] = oracle(tiny_model_dir, prompt.messages, prompt.images, opts, compiler, eos)
    two = dataclasses.replace(base, structured=CONSTRAINTS["nested"], n=2)
    requests.append((prompts[0], prompts[0].request("two", two)))
    expected["two"] = oracle(tiny_model_dir, prompts[0].messages, [], two, compiler, eos)
    second = dataclasses.replace(two, seed=None if two.seed is None else two.seed + 1)
    expected["two/1"] = oracle(tiny_model_dir, prompts[0].messages, [], second, compiler, eos)
    engine, steps = _engine(loaded), []
    results = _run(engine, requests, steps)
    assert len(requests) >= 32 and sum(r.sampling.structured is not None for _, r in requests) >= 32
    assert {rid: results[rid].tokens for rid in expected} == expected
    stopped = 0
    for i in range(len(prompts)):
        for name, constraint in CONSTRAINTS.items():
            result = results[f"{name}{i}"]
            if result.finish_reason == "stop":
                stopped += 1
                assert result.tokens[-1] in eos
                check_valid(name, constraint, adapter.tokenizer.decode(result.tokens[:-1]))
            else:
                assert result.finish_reason == "length" and len(result.tokens) == MAX_TOKENS
    assert stopped >= len(CONSTRAINTS)  # the bounded ones finish on this model
    assert engine.structured.cache.compiles == len(CONSTRAINTS)  # one compile per constraint, shared
    if not seeded:  # the ITL target and decode priority split prefills into small chunks beside the masked decodes
        paced = _run(_engine(loaded, itl_target_ms=1.0, prefill_tokens_per_free_seq=2), requests, steps)
        assert {rid: paced[rid].tokens for rid in expected} == expected
        assert steps[1] > steps[0], steps  # the prefills did go in more, smaller chunks


def test_a_constraint_that_cannot_finish_ends_length_and_logprobs_stay_raw(
    loaded: tuple[Any, Any], prompts: list[Prompt]
) -> None:
    prompt = prompts[0]
    long = SamplingOptions(max_tokens=5, logprobs=3, structured=Constraint("regex", "a{40}"))
    plain = SamplingOptions(max_tokens=1, logprobs=3)
    engine = _engine(loaded)
    results: dict[str, Any] = {}
    engine.add_request(prompt.request("long", long))
    engine.add_request(prompt.request("plain", plain))
    for _ in range(100):
        if not engine.has_work():
            break
        for out in engine.step():
            results.setdefault(out.request_id, []).append(out)
    tokens = [t for out in results["long"] for t in out.new_token_ids]
    assert results["long"][-1].finish_reason == "length" and len(tokens) == 5
    assert set(loaded[0].tokenizer.decode(tokens)) == {"a"}
    raw, masked = results["plain"][0].logprobs[0], results["long"][0].logprobs[0]
    assert masked.top_ids == raw.top_ids and masked.top_logprobs == pytest.approx(raw.top_logprobs, abs=1e-5)
    assert masked.logprob < -0.01  # the raw distribution's: under the mask alone "a" would have probability 1


def test_a_continuation_rebuilds_its_matcher_from_the_tokens_generated_before(
    loaded: tuple[Any, Any], prompts: list[Prompt]
) -> None:
    prompt = prompts[1]
    opts = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.8, seed=9, structured=CONSTRAINTS["string"])
    whole = _run(_engine(loaded), [(prompt, prompt.request("whole", opts))])["whole"]
    assert len(whole.tokens) > 8
    for cut in (1, 6):
        continued = EngineRequest(
            f"cont{cut}",
            [*prompt.token_ids, *whole.tokens[:cut]],
            list(prompt.media),
            dataclasses.replace(opts, max_tokens=opts.max_tokens - cut),
            generated_tokens=cut,
        )
        rest = _run(_engine(loaded), [(prompt, continued)])[f"cont{cut}"]
        assert whole.tokens[:cut] + rest.tokens == whole.tokens and rest.finish_reason == whole.finish_reason
    misfit = [*prompt.token_ids, *whole.tokens[1:3]]  # '"n' without the '{' before it: no JSON the schema allows
    wrong = EngineRequest("wrong", misfit, list(prompt.media), opts, generated_tokens=2)
    assert _run(_engine(loaded), [(prompt, wrong)])["wrong"] == Result([], "error")


def test_a_constraint_that_does_not_compile_ends_error_and_is_then_refused(
    loaded: tuple[Any, Any], prompts: list[Prompt]
) -> None:
    prompt = prompts[0]
    engine = _engine(loaded)
    bad = SamplingOptions(max_tokens=8, n=2, structured=Constraint("regex", "(?=a)b"))
    good = SamplingOptions(max_tokens=4)
    # the compile thread busy until both are admitted: a lookahead fails to compile in microseconds, and once
    # that is known a request is refused at admission (below) instead of ending "error"
    gate = threading.Event()
    engine.structured.cache._pool.submit(gate.wait, 10)
    engine.add_request(prompt.request("bad", bad))
    engine.add_request(prompt.request("good", good))
    gate.set()
    results = _run(engine, [])
    assert results["bad"] == Result([], "error") and results["bad/1"] == Result([], "error")
    assert len(results["good"].tokens) == 4
    with pytest.raises(ValueError, match="Lookahead is not supported"):
        engine.admit(prompt.request("again", bad))
    assert not engine.requests and engine.scheduler.ledger.reserved_blocks == 0


def test_min_tokens_holds_the_stop_back_only_while_the_grammar_could_go_on(
    loaded: tuple[Any, Any], prompts: list[Prompt]
) -> None:
    """A choice complete before min_tokens ends there ("stop", its eos last: banning the stop would leave no
    token at all); a regex that may go on makes at least min_tokens tokens."""
    adapter, _ = loaded
    prompt, eos = prompts[0], set(adapter.eos_token_ids)
    short = SamplingOptions(max_tokens=12, min_tokens=6, structured=Constraint("choice", '["a"]'))
    longer = SamplingOptions(max_tokens=12, min_tokens=6, structured=Constraint("regex", "a+"))
    requests = [(prompt, prompt.request("short", short)), (prompt, prompt.request("long", longer))]
    results = _run(_engine(loaded), requests)
    assert results["short"].finish_reason == "stop" and results["short"].tokens[-1] in eos
    assert adapter.tokenizer.decode(results["short"].tokens[:-1]) == "a"
    made = results["long"]
    assert len(made.tokens) >= 6 and set(adapter.tokenizer.decode([t for t in made.tokens if t not in eos])) == {"a"}


@pytest.mark.parametrize("beside", [True, False], ids=["grammar-thread", "engine-thread"])
def test_a_step_mask_in_any_row_order_masks_as_xgrammar_and_its_verdicts_follow_the_matchers(
    loaded: tuple[Any, Any], compiler: Any, beside: bool
) -> None:
    """The CPU's additive bias and xgrammar's kernel (the other devices' path) give the same masked logits, bit
    for bit, whatever rows are constrained and in whatever order the prefetched fill laid them out; a token's
    verdict is what a fresh matcher fed the same tokens says, and the grammar thread's accepts land before the
    next fill."""
    adapter, model = loaded
    vocab = model.get_output_embeddings().out_features
    structured = StructuredOutputs(adapter.tokenizer, vocab, frozenset(adapter.eos_token_ids), 8, 1 << 30, 10.0,
                                   torch.device("cpu"), beside)  # fmt: skip
    kinds = ["nested", "regex", "choice", "string"]
    states = [structured.state(CONSTRAINTS[name]) for name in kinds]
    for state in states:
        while not state.ready:
            assert state.start([]) is None
    references = [xgr.GrammarMatcher(compiler.compile_grammar(grammar_of(CONSTRAINTS[name]))) for name in kinds]
    io = HostDevice(torch.device("cpu"))
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    step = [None, states[2], states[0], None, states[3], states[1]]  # rows 1, 2, 4, 5 constrained
    orders = [[states[0], states[1], states[2], states[3]], [states[2], states[0], states[3], states[1]]]
    seen = set()
    for turn in range(6):
        structured.prefetch(orders[turn % 2])  # the first order differs from the step's: rows mapped
        mask = structured.step_mask(step)
        assert mask is not None and mask.rows == [i for i, state in enumerate(step) if state is not None]
        by_bias = mask.apply(logits, io)
        kernel = StepMask(mask.rows, mask.states, mask.source, mask.bitmask, None, mask.stop_ids)
        assert torch.equal(by_bias, kernel.apply(logits, io))
        assert torch.equal(by_bias[[0, 3]], logits[[0, 3]])
        tokens = by_bias.argmax(dim=-1).tolist()
        if turn == 1:  # a token the grammar of the last row does not allow now: refused
            tokens[mask.rows[-1]] = next(t for t in range(vocab) if not mask.allows(len(mask.rows) - 1, t))
        verdicts = structured.accept(mask, tokens)
        for row, state in zip(mask.rows, mask.states, strict=True):
            reference = references[states.index(state)]
            allowed = reference.accept_token(tokens[row]) if not reference.is_terminated() else False
            stopped = allowed and reference.is_terminated()
            assert verdicts.get(row) == (STOPPED if stopped else None if allowed else REFUSED), (turn, row)
            seen.add(verdicts.get(row))
        step = [s if s is None or verdicts.get(i) is None else None for i, s in enumerate(step)]
        orders = [[s for s in order if s in step] for order in orders]
        if not any(step):
            break
    assert REFUSED in seen and None in seen
    structured.close()


@pytest.mark.parametrize("beside", [True, False], ids=["grammar-thread", "engine-thread"])
def test_the_fill_queued_with_the_accepts_serves_a_step_with_fewer_rows_and_one_with_more_fills_anew(
    loaded: tuple[Any, Any], compiler: Any, beside: bool
) -> None:
    """The accepts queue the same rows' next fill: a step that lost a row without a verdict (its max_tokens)
    uses it, mapped, and queues nothing; a step with a row it lacks (a new request) queues its own fill (on the
    grammar thread; on the engine thread ``step_mask`` fills it). Each
    step's masked logits equal xgrammar's kernel applied with a fresh matcher's bitmask fed the same tokens."""
    adapter, model = loaded
    vocab = model.get_output_embeddings().out_features
    structured = StructuredOutputs(adapter.tokenizer, vocab, frozenset(adapter.eos_token_ids), 8, 1 << 30, 10.0,
                                   torch.device("cpu"), beside)  # fmt: skip
    kinds = ["nested", "regex", "string"]
    states = [structured.state(CONSTRAINTS[name]) for name in kinds]
    for state in states:
        while not state.ready:
            assert state.start([]) is None
    references = [xgr.GrammarMatcher(compiler.compile_grammar(grammar_of(CONSTRAINTS[name]))) for name in kinds]
    io = HostDevice(torch.device("cpu"))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    a, b, c = states
    for step, queued in ([a, b, None], True), ([None, b, None], False), ([None, b, c], True):
        before = structured._pending
        structured.prefetch([s for s in step if s is not None])
        assert (structured._pending is not before) == (queued and beside)  # on the engine thread step_mask fills
        mask = structured.step_mask(step)
        assert mask is not None
        expected = logits.clone()
        bitmask = xgr.allocate_token_bitmask(len(step), vocab)
        for row, state in zip(mask.rows, mask.states, strict=True):
            references[states.index(state)].fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=mask.rows)
        masked = mask.apply(logits, io)
        assert torch.equal(masked, expected)
        tokens = masked.argmax(dim=-1).tolist()
        assert structured.accept(mask, tokens) == {}  # allowed, and no grammar complete yet
        for row, state in zip(mask.rows, mask.states, strict=True):
            assert references[states.index(state)].accept_token(tokens[row])
    structured.close()


def test_jobs_the_grammar_thread_has_not_started_are_taken_back_and_none_runs_twice(loaded: tuple[Any, Any]) -> None:
    """With the grammar thread busy, a step that needs its queued accepts and fill takes them back: the accept
    runs on the caller's thread, in order, the fill is dropped (the caller fills), and the thread, free again,
    starts neither."""
    adapter, model = loaded
    structured = StructuredOutputs(adapter.tokenizer, 8, frozenset(adapter.eos_token_ids), 1, 1 << 20, 1.0,
                                   torch.device("cpu"), beside=True)  # fmt: skip
    free = threading.Event()
    ran: list[str] = []
    structured._submit(lambda: free.wait(5) and ran.append("busy"))
    structured._submit(lambda: ran.append(f"accept on {threading.current_thread().name}"))
    fill = structured._submit(lambda: ran.append("fill"), redo=False)
    threading.Timer(0.05, free.set).start()
    assert structured._settle(fill) is False
    time.sleep(0.05)  # the thread, free, would run what it still held
    assert ran == ["busy", f"accept on {threading.current_thread().name}"]
    done = structured._submit(lambda: ran.append("fill"), redo=False)
    done.result()
    assert structured._settle(done) is True and ran[-1] == "fill"  # the thread ran it: its result is used
    structured.close()
