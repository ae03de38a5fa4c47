"""vLLM's sampling options in the engine equal transformers' `generate` with the matching logits processors
(tests/oracle_processors.py): repetition, presence and frequency penalties, min_p, min_tokens, stop_token_ids,
bad words and logit_bias, greedy and seeded, each alone and all mixed in one batch with plain requests and a
request of two choices; each option changes the answer; a continuation (a migrated request) counts the tokens
generated before it, so it goes on as the undisturbed run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.engine_support import Prompt, Result, build_prompt, image
from tests.oracle_processors import hf_generate_with

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 10


def _engine(loaded: tuple[Any, Any]) -> Engine:
    adapter, model = loaded
    return Engine(adapter, model, EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=96, max_num_seqs=32))


def _run(engine: Engine, requests: list[tuple[Prompt, EngineRequest]]) -> dict[str, Result]:
    """All ``requests`` queued at once (one batch), run to the end; the results by request id ("<id>/<i>"
    for a later choice)."""
    for prompt, request in requests:
        for mm_hash, tensor in prompt.embeddings.items():
            engine.provide_embedding(mm_hash, tensor)
        engine.add_request(request)
    results: dict[str, Result] = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for out in engine.step():
            key = out.request_id if out.index == 0 else f"{out.request_id}/{out.index}"
            result = results.setdefault(key, Result())
            result.tokens.extend(out.new_token_ids)
            if out.finished:
                result.finish_reason = out.finish_reason
    assert not engine.requests
    return results


@pytest.fixture(scope="module")
def prompts(loaded: tuple[Any, Any]) -> list[Prompt]:
    adapter, model = loaded
    return [
        build_prompt(adapter, model, ["count to ten and then some more"]),
        build_prompt(adapter, model, ["tell me about", image(64, 48, 41), "this picture"]),
    ]


def _base(seeded: bool) -> SamplingOptions:
    if seeded:
        return SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.9, top_k=40, seed=11, ignore_eos=True)
    return SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=True)


def _cases(plain: list[int], eos: int, seeded: bool) -> dict[str, SamplingOptions]:
    """Each option alone, with values that change this prompt's answer (``plain``: its answer without them), and
    all of them together."""
    base = _base(seeded)
    cases = {
        "repetition": dataclasses.replace(base, repetition_penalty=0.2),  # rewards the prompt's and output's tokens
        "frequency": dataclasses.replace(base, frequency_penalty=-2.0),
        "presence": dataclasses.replace(base, presence_penalty=-2.0),
        "bad_words": dataclasses.replace(base, bad_words=((plain[0], plain[1]), (plain[3],))),
        "logit_bias": dataclasses.replace(base, logit_bias=((plain[2], -100.0), (plain[5], 4.0), (7, 3.5))),
        # eos made certain by a bias, held back by min_tokens: ends "stop" after exactly min_tokens + 1 tokens
        "min_tokens": dataclasses.replace(base, ignore_eos=False, min_tokens=4, logit_bias=((eos, 100.0),)),
        "stop_token_ids": dataclasses.replace(base, stop_token_ids=(plain[4],)),
        "stop_after_min": dataclasses.replace(base, stop_token_ids=(9,), min_tokens=3, logit_bias=((9, 100.0),)),
        "all": dataclasses.replace(
            base,
            ignore_eos=False,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            min_tokens=2,
            stop_token_ids=(plain[6],),
            bad_words=((plain[0],), (plain[1], plain[2])),
            logit_bias=((plain[3], 2.0),),
            min_p=0.05 if seeded else 0.0,
        ),
    }
    if seeded:
        cases["min_p"] = dataclasses.replace(base, min_p=0.6)
        cases["min_p_top_p"] = dataclasses.replace(base, top_k=0, min_p=0.3, top_p=0.8)
    return cases


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_each_option_alone_and_mixed_equals_generate(
    loaded: tuple[Any, Any], tiny_model_dir: Path, prompts: list[Prompt], seeded: bool
) -> None:
    adapter, _ = loaded
    eos_ids = adapter.eos_token_ids
    eos = eos_ids[0]
    base = _base(seeded)
    plain = _run(_engine(loaded), [(p, p.request(f"plain{i}", base)) for i, p in enumerate(prompts)])
    requests: list[tuple[Prompt, EngineRequest]] = []
    expected: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        reference = plain[f"plain{i}"].tokens
        assert reference == hf_generate_with(tiny_model_dir, prompt.messages, prompt.images, base, [eos])
        for name, opts in _cases(reference, eos, seeded).items():
            rid = f"{name}{i}"
            expected[rid] = hf_generate_with(tiny_model_dir, prompt.messages, prompt.images, opts, list(eos_ids))
            assert expected[rid] != reference, f"{rid}: the option changed nothing"
            requests.append((prompt, prompt.request(rid, opts)))
    for prompt, request in requests:  # alone
        assert _run(_engine(loaded), [(prompt, request)])[request.request_id].tokens == expected[request.request_id]
    if seeded:  # two choices: the second draws from seed + 1, penalised by its own output
        opts = dataclasses.replace(_cases(plain["plain0"].tokens, eos, seeded)["all"], n=2)
        requests.append((prompts[0], prompts[0].request("two", opts)))
        expected["two"] = hf_generate_with(tiny_model_dir, prompts[0].messages, [], opts, adapter.eos_token_ids)
        second = dataclasses.replace(opts, seed=opts.seed + 1)
        expected["two/1"] = hf_generate_with(tiny_model_dir, prompts[0].messages, [], second, adapter.eos_token_ids)
    plain_again = [(p, p.request(f"again{i}", base)) for i, p in enumerate(prompts)]
    mixed = _run(_engine(loaded), [plain_again[0], *requests, plain_again[1]])
    for rid, tokens in expected.items():
        assert mixed[rid].tokens == tokens, rid
    for i in range(len(prompts)):
        assert mixed[f"again{i}"].tokens == plain[f"plain{i}"].tokens
    for i in range(len(prompts)):
        assert len(mixed[f"min_tokens{i}"].tokens) == 5 and mixed[f"min_tokens{i}"].finish_reason == "stop"
        assert mixed[f"stop_after_min{i}"].tokens == [*mixed[f"stop_after_min{i}"].tokens[:3], 9]
        assert mixed[f"stop_token_ids{i}"].finish_reason == "stop"


def test_a_continuation_counts_the_tokens_generated_before(loaded: tuple[Any, Any], prompts: list[Prompt]) -> None:
    """A request continued from prompt + its first ``cut`` tokens (``generated_tokens``, remaining max_tokens, the
    same min_tokens) gives the undisturbed run's rest: the penalties, the bad words' prefixes and min_tokens
    count the tokens generated before the cut as output."""
    prompt = prompts[1]
    adapter, _ = loaded
    sampling = SamplingOptions(
        max_tokens=12, temperature=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.5,
        min_tokens=8, logit_bias=((adapter.eos_token_ids[0], 6.0),),
    )  # fmt: skip
    whole = _run(_engine(loaded), [(prompt, prompt.request("whole", sampling))])["whole"].tokens
    assert len(whole) > 8
    with_word = dataclasses.replace(sampling, bad_words=((whole[6], whole[7]),))
    banned = _run(_engine(loaded), [(prompt, prompt.request("banned", with_word))])["banned"].tokens
    assert banned[:7] == whole[:7] and banned[7] != whole[7]
    for opts, run in ((sampling, whole), (with_word, banned)):
        for cut in (1, 7):
            continued = EngineRequest(
                f"cont{cut}",
                [*prompt.token_ids, *run[:cut]],
                list(prompt.media),
                dataclasses.replace(opts, max_tokens=opts.max_tokens - cut),
                generated_tokens=cut,
            )
            rest = _run(_engine(loaded), [(prompt, continued)])[f"cont{cut}"].tokens
            assert run[:cut] + rest == run, f"cut at {cut}"
