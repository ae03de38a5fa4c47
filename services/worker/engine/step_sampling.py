"""A step's sampling: grammar masks applied, seeded generators set to each row's position, one host copy.

Invariant: `sample_step` returns one ``(token, logprobs)`` per sequence of ``seqs``, in order, and the step's
grammar mask (None when no row is constrained), whose verdicts the caller takes on the sampled tokens
(``StructuredOutputs.accept``). Logprobs are of the model's logits before any mask. A row whose grammar allows
nothing but a stop this step is sampled without its ``min_tokens`` (the constraint ends the text: banning the stop
would leave the row no token at all).
"""

from __future__ import annotations

import dataclasses

import torch

from services.worker.engine.host_device import HostDevice
from services.worker.engine.request import SamplingOptions, TokenLogprobs
from services.worker.engine.sampler import Sampler, reseed_for_position
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_mask import StepMask
from services.worker.engine.structured import StructuredOutputs


def sample_step(
    sampler: Sampler, structured: StructuredOutputs, io: HostDevice, seqs: list[Sequence], logits: torch.Tensor
) -> tuple[list[tuple[int, TokenLogprobs | None]], StepMask | None]:
    """Sample ``logits [len(seqs), vocab]`` (the step's sampling rows, in ``seqs``' order); see the module
    docstring."""
    options = [s.sampling for s in seqs]
    generators = [
        None if s.generator is None else reseed_for_position(s.generator, s.sampling.seed, len(s.token_ids))
        for s in seqs
    ]
    mask = structured.step_mask([s.grammar for s in seqs])
    masked = logits
    if mask is not None:
        masked = mask.apply(logits, io)
        _stops_over_min_tokens(seqs, options, mask)
    return sampler.sample_to_host(masked, options, generators, seqs, raw_logits=logits), mask


def _stops_over_min_tokens(seqs: list[Sequence], options: list[SamplingOptions], mask: StepMask) -> None:
    """In ``options``, drop ``min_tokens`` for the rows whose grammar allows nothing but a stop this step."""
    for j, i in enumerate(mask.rows):
        opts, seq = options[i], seqs[i]
        pending = opts.min_tokens and len(seq.token_ids) - seq.output_start < opts.min_tokens
        if pending and mask.only_stop_allowed(j):
            options[i] = dataclasses.replace(opts, min_tokens=0)
