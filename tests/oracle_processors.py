"""Oracle for the engine's sampling options: transformers `generate` with the matching logits processors.

transformers' own processors where they exist (`RepetitionPenaltyLogitsProcessor` over prompt and output,
`NoBadWordsLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`, `SequenceBiasLogitsProcessor` for
`logit_bias`, the temperature / top-k / top-p / min-p warpers); OpenAI's presence and frequency penalties,
which transformers lacks, as a small processor here. Processors that read only the output (vLLM's bad words,
min_tokens, presence and frequency) see `input_ids` less the prompt (`OutputOnly`). A seeded request runs
`generate` greedily over the warped scores through `ExponentialRace`, which draws the engine's exponential
race from the same per-position seed (sampler.py's `position_seed`): the same draws, so token for token the
same answer, with transformers choosing the candidates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.models.base import ChatMessage
from services.worker.engine.request import SamplingOptions
from services.worker.engine.sampler import position_seed
from tests.oracle import _generate


class OutputOnly(LogitsProcessor):
    """``inner`` over the generated tokens only: the prompt's length is ``input_ids``' at the first call."""

    def __init__(self, inner: LogitsProcessor) -> None:
        self.inner = inner
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        return self.inner(input_ids[:, self.prompt_len :], scores)


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the tokens given: ``score - frequency * count - presence * (count > 0)``."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


class ExponentialRace(LogitsProcessor):
    """Scores whose argmax is the engine's seeded draw: ``softmax(scores) / E``, ``E ~ Exp(1)`` from a generator
    seeded ``position_seed(seed, position)`` (the position: the length of ``input_ids``)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(position_seed(self.seed, input_ids.shape[1]))
        noise = torch.empty_like(scores).exponential_(generator=generator).clamp_(min=torch.finfo(scores.dtype).tiny)
        return scores.softmax(dim=-1) / noise


def processors(opts: SamplingOptions, eos_token_ids: list[int]) -> LogitsProcessorList:
    """The processors (and for a sampled request the warpers and the race) standing for ``opts``, in the
    engine's order."""
    out: list[LogitsProcessor] = []
    if opts.bad_words:
        out.append(OutputOnly(NoBadWordsLogitsProcessor([list(w) for w in opts.bad_words])))
    if opts.min_tokens:
        stops = list(opts.stop_token_ids) + ([] if opts.ignore_eos else list(eos_token_ids))
        out.append(OutputOnly(MinNewTokensLengthLogitsProcessor(0, opts.min_tokens, stops)))
    if opts.logit_bias:
        out.append(SequenceBiasLogitsProcessor({(t,): b for t, b in opts.logit_bias}))
    if opts.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(float(opts.repetition_penalty)))
    if opts.presence_penalty or opts.frequency_penalty:
        out.append(OutputOnly(PresenceFrequencyPenalty(opts.presence_penalty, opts.frequency_penalty)))
    if opts.temperature > 0:
        assert opts.seed is not None, "an unseeded draw has no oracle"
        out.append(TemperatureLogitsWarper(opts.temperature))
        if opts.top_k:
            out.append(TopKLogitsWarper(opts.top_k))
        if 0 < opts.top_p < 1:
            out.append(TopPLogitsWarper(opts.top_p))
        if opts.min_p:
            out.append(MinPLogitsWarper(opts.min_p))
        out.append(ExponentialRace(opts.seed))
    return LogitsProcessorList(out)


def hf_generate_with(
    model_dir: Path, messages: list[ChatMessage], images: list[Image.Image], opts: SamplingOptions, eos: list[int]
) -> list[int]:
    """The completion ids ``generate`` gives for ``opts`` (greedy over the processed, or raced, scores); it stops
    at an eos id (none with ``ignore_eos``), a ``stop_token_ids`` entry, or ``max_tokens``."""
    stops = list(opts.stop_token_ids) + ([] if opts.ignore_eos else list(eos))
    kwargs: dict[str, Any] = {"logits_processor": processors(opts, eos), "eos_token_id": stops or None}
    if not stops:
        kwargs["eos_token_id"] = []
    out, prompt_len = _generate(model_dir, messages, images, opts.max_tokens, **kwargs)
    return out[0, prompt_len:].tolist()
