"""What goes into the engine and what comes out of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from services.common.grammar import Constraint
from services.common.kv_layout import KVLayout
from services.models.media_span import MediaSpan

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per token (OpenAI's limit)."""


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling. ``temperature == 0`` is greedy; ``top_p`` 0 or 1 and ``top_k`` 0 are off.

    ``n`` choices run as ``n`` sequences; with a ``seed``, choice i draws from ``seed + i``. ``logprobs``: None
    = none; 0 = the sampled token's log-probability; k = also the k most likely tokens (raw logits' softmax).

    vLLM's logits processors, each off at its default (logits_processors.py applies them, in this order):
    ``bad_words`` (token-id sequences: the last id is banned where the output ends with the rest; a one-id word
    always), ``min_tokens`` (eos, unless ``ignore_eos``, and ``stop_token_ids`` banned until that many output
    tokens), ``logit_bias`` ((token id, bias) pairs added to the logits), ``repetition_penalty`` (the logits of
    tokens in the prompt or the output divided by it when positive, multiplied when not), ``frequency_penalty``
    and ``presence_penalty`` (subtracted per occurrence, and once, for tokens in the output); then temperature,
    top-k, top-p and ``min_p`` (tokens below ``min_p`` x the top token's probability dropped). "Output" counts
    the tokens a previous worker generated (a migrated request's ``generated_tokens``).

    ``structured``: a grammar the output is held to (structured.py masks what it does not allow before the
    processors; the choice ends "stop" once the grammar is complete).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: Constraint | None = None

    @cached_property
    def processes_logits(self) -> bool:
        """True when a logits processor before temperature is on (``min_p`` is part of sampling itself); kept
        after its first reading, as the options never change (the sampler asks per row per step)."""
        return bool(
            self.repetition_penalty != 1
            or self.presence_penalty
            or self.frequency_penalty
            or self.min_tokens
            or self.bad_words
            or self.logit_bias
        )

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy with no logits processor and no logprobs: the row's token is its first argmax, nothing more
        (kept after its first reading, as ``processes_logits``)."""
        return self.temperature == 0 and self.logprobs is None and not self.processes_logits

    @cached_property
    def penalizes(self) -> bool:
        return self.repetition_penalty != 1 or bool(self.presence_penalty or self.frequency_penalty)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be within [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be within [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check_processor_options(self)


def check_processor_options(opts: SamplingOptions) -> None:
    """ValueError naming the first logits-processor option out of its bounds (NaN and infinities included)."""
    if not 0 < opts.repetition_penalty < math.inf:
        raise ValueError(f"repetition_penalty must be > 0 and finite, got {opts.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(opts, name) <= 2:
            raise ValueError(f"{name} must be within [-2, 2], got {getattr(opts, name)}")
    if not 0 <= opts.min_p <= 1:
        raise ValueError(f"min_p must be within [0, 1], got {opts.min_p}")
    if opts.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {opts.min_tokens}")
    if any(not word or min(word) < 0 for word in opts.bad_words):
        raise ValueError("bad_words: every word is a non-empty sequence of token ids")
    if any(token < 0 or not -100 <= bias <= 100 for token, bias in opts.logit_bias):
        raise ValueError("logit_bias: token ids >= 0, biases within [-100, 100]")
    if len({token for token, _ in opts.logit_bias}) < len(opts.logit_bias):
        raise ValueError("logit_bias: each token id at most once")
    if any(token < 0 for token in opts.stop_token_ids):
        raise ValueError("stop_token_ids must be >= 0")


KV_SEND = "send"
"""A remote prefill: this engine prefills the request, ships its KV blocks and first token, and ends it there."""
KV_RECEIVE = "receive"
"""A request prefilled elsewhere: this engine takes its KV blocks in and decodes from the first token on."""


@dataclass(frozen=True)
class KVTransfer:
    """A request's part in prefill/decode disaggregation (kv_connector.py): ``direction`` ``KV_SEND`` or
    ``KV_RECEIVE``; ``skip_blocks`` (send): the leading prompt blocks the decode engine already holds (its prefix
    cache), which are not shipped."""

    direction: str
    skip_blocks: int = 0

    def __post_init__(self) -> None:
        if self.direction not in (KV_SEND, KV_RECEIVE):
            raise ValueError(f"KV transfer direction must be {KV_SEND!r} or {KV_RECEIVE!r}, got {self.direction!r}")
        if self.skip_blocks < 0:
            raise ValueError(f"skip_blocks must be >= 0, got {self.skip_blocks}")


@dataclass
class EngineRequest:
    """One generation request as the worker server hands it to the engine."""

    request_id: str
    token_ids: list[int]
    media: list[MediaSpan] = field(default_factory=list)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    cache_salt: str = ""
    generated_tokens: int = 0
    """The last ``generated_tokens`` of ``token_ids`` were generated elsewhere (a migrated request): they are
    prefilled like the prompt but positioned as decoded text, as ``generate`` positions its own output."""
    kv_transfer: KVTransfer | None = None
    """Set for a request prefilled on one engine and decoded on another (None: both here)."""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability and the top alternatives (most likely first), from the log-softmax
    of the raw logits (before temperature, top-k, top-p)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class StepOutput:
    """New tokens of one choice of a request after a step.

    ``finished``: this choice finished (``finish_reason`` "stop" or "length"); ``request_finished``: so did
    every choice of the request (the request's last output). ``logprobs`` has one entry per new token when the
    request asked for them, else None.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    cached_tokens: int
    index: int = 0
    logprobs: list[TokenLogprobs] | None = None
    request_finished: bool = False


@dataclass(frozen=True)
class KVState:
    """The KV picture a worker publishes for the router's admission and placement."""

    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    running: int
    waiting: int
    block_size: int
    preemptions: int = 0  # since start; stays 0 with overcommit 1.0
    attention_backend: str = ""  # the engine's, resolved (never "auto")
    pinned_embeddings: int = 0  # media embeddings held for admitted requests (0 when none is in flight)
    kv_layout: KVLayout | None = None  # its blocks' identity (model_revision filled in by the worker)
