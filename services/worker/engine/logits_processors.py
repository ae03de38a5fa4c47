"""vLLM's logits processors on the logits' device, batched over the rows that ask: bad words, min_tokens,
logit_bias, and the repetition, frequency and presence penalties.

Invariant: a step whose rows ask for none of them costs nothing here; otherwise the host walks the asking rows
(never the vocabulary), makes one int64 and one float32 upload, and the device does the rest in a fixed number
of batched ops, with no host read. The raw logits are never written (logprobs are read from them).
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.engine.host_device import HostDevice
from services.worker.engine.request import SamplingOptions


class TokenHistory(Protocol):
    """What the processors read of a row's sequence: its tokens, where its output starts (tokens a previous
    worker generated count as output), and the distinct ids before that."""

    token_ids: list[int]

    @property
    def output_start(self) -> int: ...

    @property
    def distinct_prompt_ids(self) -> tuple[int, ...]: ...


def banned_ids(opts: SamplingOptions, history: TokenHistory, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids a row may not take this step: the last id of each bad word whose other ids end the output (a
    one-id word always; the prompt never completes a word, as in vLLM), and, while the output is shorter than
    ``min_tokens``, the stop ids (``stop_token_ids``, and eos unless ``ignore_eos``)."""
    tokens, start = history.token_ids, history.output_start
    produced = len(tokens) - start
    banned = []
    for word in opts.bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (produced >= prefix and tuple(tokens[-prefix:]) == word[:-1]):
            banned.append(word[-1])
    if produced < opts.min_tokens:
        banned.extend(opts.stop_token_ids)
        if not opts.ignore_eos:
            banned.extend(eos_token_ids)
    return banned


def processing_rows(options: list[SamplingOptions], histories: list[TokenHistory] | None) -> list[int]:
    """The rows with a processor to apply this step (a row whose only one is a ``min_tokens`` already reached
    has none); ``histories`` may be None only when no row's options process logits."""
    rows = [i for i, opts in enumerate(options) if opts.processes_logits]
    if rows and histories is None:
        raise ValueError("logits processors need each row's token history")
    return [i for i in rows if _active(options[i], histories[i])]  # type: ignore[index]


def _active(opts: SamplingOptions, history: TokenHistory) -> bool:
    return bool(
        opts.penalizes
        or opts.bad_words
        or opts.logit_bias
        or len(history.token_ids) - history.output_start < opts.min_tokens
    )


def process_logits(
    logits: torch.Tensor,
    rows: list[int],
    options: list[SamplingOptions],
    histories: list[TokenHistory],
    eos_token_ids: frozenset[int],
    io: HostDevice,
) -> torch.Tensor:
    """``logits [N, vocab]`` as float32, ``rows`` (``processing_rows``) processed in vLLM's order: bad words
    and min_tokens (-inf), logit_bias (added), then the penalties over the biased logits: repetition (tokens
    of the prompt or the output: ``x / p`` where ``x > 0``, else ``x * p``), frequency (``- f * count`` of the
    token in the output) and presence (``- q`` once it is in the output). A new tensor; ``logits`` stays as
    it was."""
    vocab = logits.shape[-1]
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    biases: list[float] = []
    seen_rows: list[int] = []
    seen_ids: list[int] = []
    out_rows: list[int] = []
    out_ids: list[int] = []
    penalties: list[float] = []
    penalized = any(options[i].penalizes for i in rows)
    for row, i in enumerate(rows):
        opts, history = options[i], histories[i]
        banned = banned_ids(opts, history, eos_token_ids)
        ban_rows += [row] * len(banned)
        ban_ids += banned
        for token, bias in opts.logit_bias:
            bias_rows.append(row)
            bias_ids.append(token)
            biases.append(bias)
        if not penalized:
            continue
        penalties += [opts.repetition_penalty, opts.frequency_penalty, opts.presence_penalty]
        if not opts.penalizes:
            continue
        output = history.token_ids[history.output_start :]
        out_rows += [row] * len(output)
        out_ids += output
        if opts.repetition_penalty != 1:
            prompt = [t for t in history.distinct_prompt_ids if t < vocab]  # as transformers, ids past the head
            seen_rows += [row] * len(prompt)
            seen_ids += prompt
    ints = io.upload(
        rows + ban_rows + ban_ids + bias_rows + bias_ids + out_rows + out_ids + seen_rows + seen_ids, torch.int64
    )
    floats = io.upload(biases + penalties, torch.float32) if biases or penalties else None
    taken = [len(rows), len(ban_rows), len(ban_ids), len(bias_rows), len(bias_ids)]
    index, ban_r, ban_t, bias_r, bias_t, out_r, out_t, seen_r, seen_t = ints.split(
        [*taken, len(out_rows), len(out_ids), len(seen_rows), len(seen_ids)]
    )
    scores = logits.index_select(0, index).float()
    if ban_rows:
        scores.index_put_((ban_r, ban_t), scores.new_full((), float("-inf")))  # a fill, not an upload
    if bias_rows:  # index_add_: atomic adds on CUDA, where an accumulating index_put_ sorts its indices
        scores.view(-1).index_add_(0, bias_r * vocab + bias_t, floats[: len(biases)])
    if penalties:
        params = floats[len(biases) :].view(-1, 3)
        scores = penalize(scores, params[:, 0:1], params[:, 1:2], params[:, 2:3], (out_r, out_t), (seen_r, seen_t))
    return logits.to(torch.float32, copy=True).index_copy_(0, index, scores)


def penalize(
    scores: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    output: tuple[torch.Tensor, torch.Tensor],
    prompt: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """``scores [R, vocab]`` penalized per row (``[R, 1]`` parameters; 1, 0, 0 leave a row as it was, bit for
    bit) given the (row, id) pairs of each row's output tokens (repeats counted) and of its distinct prompt ids."""
    counts = torch.zeros_like(scores)
    rows, ids = output
    counts.view(-1).index_add_(0, rows * scores.shape[-1] + ids, torch.ones_like(ids, dtype=scores.dtype))
    generated = counts > 0
    seen = generated.clone()
    seen.index_put_(prompt, seen.new_ones(()))
    scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
    scores = scores - frequency * counts
    return scores - presence * generated


def check_token_ids(opts: SamplingOptions, vocab: int, generated: list[int]) -> None:
    """ValueError when an id of ``stop_token_ids``, ``bad_words`` or ``logit_bias``, or of the tokens a
    previous worker ``generated`` when a penalty counts them, is outside the vocabulary (``vocab`` logits):
    indexing the device's logits with it would fault."""
    ids = [*opts.stop_token_ids, *(t for word in opts.bad_words for t in word), *(t for t, _ in opts.logit_bias)]
    if opts.penalizes:
        ids += generated
    if ids and max(ids) >= vocab:
        raise ValueError(f"token id {max(ids)} is outside the model's vocabulary of {vocab}")
