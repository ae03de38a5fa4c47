"""Next-token sampling on the logits' device: logits processors, greedy, temperature, top-k, top-p, min-p,
per-request seed, logprobs."""

from __future__ import annotations

import torch

from services.worker.engine.host_device import HostDevice
from services.worker.engine.logits_processors import TokenHistory, process_logits, processing_rows
from services.worker.engine.request import SamplingOptions, TokenLogprobs


class Sampler:
    """Turns the logits of the sampling rows into token ids, without leaving the device.

    First the rows that ask for vLLM's logits processors (penalties, bad words, min_tokens, logit_bias) get
    them (logits_processors.py; rows that ask for none are not touched). Greedy rows take the first argmax
    (as transformers' ``generate``). The other rows, together: divide by the temperature, keep the top-k
    values (ties kept), then the smallest set holding top-p of the mass, then the tokens with at least
    min-p x the top token's probability (transformers' order of its warpers; vLLM applies min-p before
    top-k/top-p), then draw by an exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` (the same distribution as
    ``multinomial``, with no host sync). Each row's ``E`` comes from its request's own device generator
    when it has a seed, so a seeded request draws the same numbers alone or in any batch; else from the
    sampler's shared generator. A seeded row's generator is reseeded for each token from the seed and the
    token's position (``position_seed``), so the draws depend on nothing else: a request continued elsewhere
    with its prompt plus the tokens generated so far (a router migration) draws the same numbers. The few
    per-row parameters go up through ``io`` (pinned, non-blocking).
    Log-probabilities are the log-softmax of the raw logits (before any processor), computed here too;
    ``sample_to_host`` brings the ids and them back in one copy.
    """

    def __init__(self, seed: int, io: HostDevice, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.io = io
        self.generator = torch.Generator(device=io.device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back (with each request's stop_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
        histories: list[TokenHistory] | None = None,
    ) -> torch.Tensor:
        """One token id per row of ``logits [N, vocab]`` as a ``[N]`` int64 tensor on the logits' device;
        ``histories`` (each row's sequence) is needed when a row's options process logits."""
        processed = processing_rows(options, histories)
        if processed:
            logits = process_logits(logits, processed, options, histories, self.eos_token_ids, self.io)  # type: ignore[arg-type]
        tokens = logits.argmax(dim=-1)
        drawn = [i for i, opts in enumerate(options) if opts.temperature > 0]
        if not drawn:
            return tokens
        chosen = [options[i] for i in drawn]
        rows, vocab = len(drawn), logits.shape[-1]
        filtered = any(0 < o.top_k < vocab or 0 < o.top_p < 1 for o in chosen)
        min_p = any(o.min_p > 0 for o in chosen)
        ints, floats = list(drawn), [o.temperature for o in chosen]
        if filtered:
            ints += [o.top_k if 0 < o.top_k < vocab else vocab for o in chosen]
            floats += [o.top_p if 0 < o.top_p < 1 else 1.0 for o in chosen]
        if min_p:
            floats += [o.min_p for o in chosen]
        int_params = self.io.upload(ints, torch.int64)  # one upload per dtype: rows (+ top-k), temperatures (+ top-p)
        float_params = self.io.upload(floats, torch.float32)  # (+ min-p)
        index = int_params[:rows]
        scaled = logits.index_select(0, index).float() / float_params[:rows, None]
        if filtered:
            scaled = filter_top_k_top_p(scaled, int_params[rows:], float_params[rows : 2 * rows])
        probs = scaled.softmax(dim=-1)
        if min_p:
            scaled = filter_min_p(scaled, probs, float_params[-rows:])
            probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, i in enumerate(drawn):
            if generators[i] is not None:
                noise[row].exponential_(generator=generators[i])
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a zero draw must not turn a dropped token into 0/0
        return tokens.index_copy(0, index, (probs / noise).argmax(dim=-1))

    def sample_to_host(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
        histories: list[TokenHistory] | None = None,
        raw_logits: torch.Tensor | None = None,
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """Per row: the sampled token id and, when its request asks, its logprobs (of ``raw_logits``, the
        model's before any grammar mask, when ``logits`` are masked); one device-to-host copy.

        When every row is ``plain_greedy`` (the common decode step) the ids are read as ``io.argmax_to_host``: on
        the CPU numpy's argmax of the logits as they are, with no tensor made for them."""
        if all(o.plain_greedy for o in options):
            return [(token, None) for token in self.io.argmax_to_host(logits)]
        tokens = self.sample(logits, options, generators, histories)
        packed = pack_logprobs(logits if raw_logits is None else raw_logits, tokens, options)
        return unpack_logprobs(self.io.to_host(packed), options)


def pack_logprobs(logits: torch.Tensor, tokens: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """What a step reads back, as one tensor on the logits' device.

    ``tokens [N]`` itself when no row asks for logprobs. Else float64 ``[N, 2 + 2k]``, k the most any row asks:
    per row the token id, its log-probability, the k most likely ids, their log-probabilities (``topk`` order:
    most likely first), all from ``log_softmax`` of the raw logits, computed for every row (rows that did not
    ask are ignored by ``unpack_logprobs``). Token ids are exact in float64.
    """
    top = max((o.logprobs for o in options if o.logprobs is not None), default=None)
    if top is None:
        return tokens
    logprobs = logits.float().log_softmax(dim=-1)
    parts = [tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double()]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        parts += [ids.double(), values.double()]
    return torch.cat(parts, dim=1)


def unpack_logprobs(rows: list, options: list[SamplingOptions]) -> list[tuple[int, TokenLogprobs | None]]:
    """``pack_logprobs``'s result read on the host (``tolist``), split per row into (id, logprobs or None)."""
    if not rows or not isinstance(rows[0], list):
        return [(token, None) for token in rows]
    width = (len(rows[0]) - 2) // 2
    out: list[tuple[int, TokenLogprobs | None]] = []
    for row, opts in zip(rows, options, strict=True):
        k = opts.logprobs
        if k is None:
            out.append((int(row[0]), None))
            continue
        top_ids = tuple(int(i) for i in row[2 : 2 + k])
        out.append((int(row[0]), TokenLogprobs(row[1], top_ids, tuple(row[2 + width : 2 + width + k]))))
    return out


def filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled [R, vocab]`` with tokens outside each row's top-k (``top_k [R]``, ``vocab`` = off; values equal
    to the k-th kept) then outside its top-p (``top_p [R]``, 1.0 = off; the smallest set holding that mass of
    the top-k distribution) set to -inf."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # ties: lower token id first
    kth = sorted_logits.gather(1, (top_k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def filter_min_p(scaled: torch.Tensor, probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``scaled [R, vocab]`` with the tokens whose probability (``probs``, its softmax) is below ``min_p [R]``
    x the row's top probability set to -inf (0 = off; the top token always stays), as transformers'
    ``MinPLogitsWarper``."""
    return scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))


_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for the token at index ``position`` of a sequence (prompt tokens included) of a
    request seeded ``seed``: ``splitmix64(seed + (position + 1) * 0x9E3779B97F4A7C15)`` (mod 2**64).

    Invariant: it depends on ``seed`` and ``position`` only, so the same request sampled alone, in any batch,
    or continued on another worker from prompt + generated tokens draws the same numbers at each position.
    """
    z = (seed + (position + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def reseed_for_position(generator: torch.Generator | None, seed: int | None, position: int) -> torch.Generator | None:
    """``generator`` reseeded for the token at ``position`` (``position_seed``); None stays None (unseeded)."""
    if generator is None or seed is None:
        return generator
    return generator.manual_seed(position_seed(seed, position))
