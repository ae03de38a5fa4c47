"""The logits processors on their own: bit for bit transformers' processed scores at every step of a `generate`,
the logprobs still the raw distribution's, bad words matched against the output only, rows that ask for nothing
left alone, and bad values refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models.base import ChatMessage, ChatPart
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.host_device import HostDevice
from services.worker.engine.logits_processors import banned_ids, process_logits, processing_rows
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.sampler import Sampler
from tests.oracle import _generate
from tests.oracle_processors import processors

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = HostDevice(torch.device("cpu"))


@dataclass
class History:
    token_ids: list[int]
    output_start: int

    @property
    def distinct_prompt_ids(self) -> tuple[int, ...]:
        return tuple(set(self.token_ids[: self.output_start]))


@pytest.mark.parametrize(
    "opts",
    [
        SamplingOptions(max_tokens=12, repetition_penalty=0.2),
        SamplingOptions(
            max_tokens=12, repetition_penalty=1.7, frequency_penalty=0.7, presence_penalty=-0.3, min_tokens=5,
            bad_words=((101,), (435, 70), (12, 13, 14)), logit_bias=((5, 1.5), (556, 3.0), (499, -100.0)),
            stop_token_ids=(17,),
        ),
    ],
    ids=["repetition", "all"],
)  # fmt: skip
def test_processed_logits_are_transformers_scores_bit_for_bit(tiny_model_dir: Path, opts: SamplingOptions) -> None:
    """At each step of a greedy `generate` with the matching processors, the engine's processors turn the raw
    logits (``output_logits``) into exactly the scores `generate` chose from (``output_scores``)."""
    eos = [556, 554]
    messages = [ChatMessage("user", [ChatPart("text", "count to ten and then some more")])]
    out, prompt_len = _generate(
        tiny_model_dir, messages, [], opts.max_tokens, logits_processor=processors(opts, eos),
        eos_token_id=[*eos, *opts.stop_token_ids], output_logits=True, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    sequence = out.sequences[0].tolist()
    assert len(out.logits) > 3
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        history = History(sequence[: prompt_len + step], prompt_len)
        got = process_logits(raw.clone(), [0], [opts], [history], frozenset(eos), CPU)
        assert torch.equal(got, scores), f"step {step}"


def test_logprobs_stay_the_raw_distributions() -> None:
    """A bias that forces a token, penalties, bans: the sampled token follows them, its logprob and the top
    alternatives are the raw logits' log-softmax; ``sample`` leaves the logits as they were."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)) * 2
    raw = logits.clone()
    history = History([1, 2, 3, 4, 4, 9], 4)
    options = [
        SamplingOptions(logit_bias=((7, 100.0),), logprobs=3),
        SamplingOptions(logprobs=2),
        SamplingOptions(temperature=0.8, seed=1, repetition_penalty=3.0, bad_words=((int(raw[2].argmax()),),),
                        frequency_penalty=2.0, logprobs=0),
    ]  # fmt: skip
    generators = [None, None, torch.Generator().manual_seed(1)]
    rows = Sampler(seed=0, io=CPU).sample_to_host(logits, options, generators, [history] * 3)
    assert torch.equal(logits, raw)
    expected = raw.log_softmax(dim=-1)
    assert rows[0][0] == 7 and rows[1][0] == int(raw[1].argmax()) and rows[2][0] != int(raw[2].argmax())
    for row, (token, lp) in enumerate(rows):
        assert lp.logprob == expected[row, token].item()
        values, ids = expected[row].topk(options[row].logprobs)
        assert lp.top_ids == tuple(ids.tolist()) and lp.top_logprobs == tuple(values.tolist())


def test_bad_words_complete_only_in_the_output() -> None:
    """vLLM's rule: the prompt never completes a bad word; the output (with tokens a previous worker generated)
    does; a one-id word is always banned; min_tokens holds back eos and the stop ids until reached."""
    opts = SamplingOptions(bad_words=((5,), (7, 8), (1, 2, 3)), min_tokens=2, stop_token_ids=(30,))
    eos = frozenset({31})
    assert sorted(banned_ids(opts, History([9, 7], 2), eos)) == [5, 30, 31]  # 7 ends the prompt: 8 allowed
    assert sorted(banned_ids(opts, History([9, 7, 1, 2], 2), eos)) == [3, 5]  # min_tokens reached
    assert sorted(banned_ids(opts, History([9, 7, 6, 7], 2), eos)) == [5, 8]
    assert sorted(banned_ids(opts, History([9, 7, 1, 2], 1), eos)) == [3, 5]  # 7, 1, 2 generated
    assert sorted(banned_ids(opts, History([1, 2, 9], 2), eos)) == [5, 30, 31]
    free = SamplingOptions(min_tokens=1, ignore_eos=True, stop_token_ids=(30,))
    assert banned_ids(free, History([9], 1), eos) == [30]


def test_rows_that_ask_for_nothing_are_left_alone() -> None:
    """Only rows with a processor to apply this step are processed (min_tokens reached: none), and the other
    rows of the batch draw exactly what they draw without it."""
    plain, greedy = SamplingOptions(temperature=1.0, seed=3), SamplingOptions()
    done = SamplingOptions(min_tokens=1)
    asking = SamplingOptions(temperature=1.0, seed=4, presence_penalty=2.0, logit_bias=((3, 5.0),))
    histories = [History([1, 2, 3], 2)] * 4
    assert processing_rows([plain, greedy, done, asking], histories) == [3]
    assert processing_rows([plain, greedy], None) == []
    with pytest.raises(ValueError, match="history"):
        processing_rows([asking], None)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(3), None, None, torch.Generator().manual_seed(4)]

    sampler = Sampler(seed=0, io=CPU)
    mixed = sampler.sample(logits, [plain, greedy, done, asking], generators(), histories)
    alone = sampler.sample(logits, [plain, greedy, done, plain], generators(), histories)
    assert mixed[:3].tolist() == alone[:3].tolist()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"bad_words": ((),)}, "bad_words"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((3, math.nan),)}, "logit_bias"),
    ],
)
def test_options_out_of_bounds_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingOptions(**fields)


def test_token_ids_outside_the_vocabulary_are_refused(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    engine = Engine(adapter, model, EngineConfig(kv_cache_bytes=1 << 20, max_num_batched_tokens=64))
    vocab = engine.vocab_size
    for opts in (
        SamplingOptions(stop_token_ids=(vocab,)),
        SamplingOptions(bad_words=((1, vocab + 5),)),
        SamplingOptions(logit_bias=((vocab, 1.0),)),
    ):
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            engine.add_request(EngineRequest("r", [1, 2, 3], sampling=opts))
    migrated = EngineRequest("m", [1, 2, vocab], sampling=SamplingOptions(presence_penalty=1.0), generated_tokens=1)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.add_request(migrated)
    assert not engine.requests
