"""What goes into the engine and what comes out of it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling. ``temperature == 0`` is greedy; ``top_p`` 0 or 1 and ``top_k`` 0 are off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be within [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class MediaInput:
    """A media item of a prompt: its placeholder tokens ``[offset, offset + num_tokens)``.

    ``grid_thw`` is the model-specific patch grid the adapter needs for positions (empty if unused).
    """

    mm_hash: str
    offset: int
    num_tokens: int
    grid_thw: tuple[int, ...] = ()


@dataclass
class EngineRequest:
    """One generation request as the worker server hands it to the engine."""

    request_id: str
    token_ids: list[int]
    media: list[MediaInput] = field(default_factory=list)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    cache_salt: str = ""


@dataclass(slots=True)
class StepOutput:
    """New tokens of one request after a step; ``finish_reason`` is "stop" or "length" once finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    cached_tokens: int


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
