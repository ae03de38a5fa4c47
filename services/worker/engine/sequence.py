"""A request's life inside the engine: tokens, computed tokens, blocks; one sequence per choice."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Container
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from services.common.block_hash import extend_block_hashes
from services.common.kv_blocks import choice_blocks, shared_prompt_blocks
from services.models.media_span import MediaSpan
from services.worker.engine.request import EngineRequest, SamplingOptions

if TYPE_CHECKING:
    from services.worker.engine.structured import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    RECEIVING = auto()  # KV computed by another engine: arriving (kv_connector.py), or arrived and ``ready``
    FINISHED = auto()


class Sequence:
    """Prompt plus generated tokens of one choice of a request.

    ``num_computed_tokens`` tokens have their K/V in the blocks of ``block_table`` (which may cover a
    few more slots, scheduled this step); the model catches up with ``num_tokens`` chunk by chunk.
    ``block_hashes`` holds the chained hashes of the full blocks of ``token_ids`` computed so far.
    ``seq_id`` = ``(request id, choice index)`` keys its reservation: unique among live sequences whatever
    the request ids look like (``name`` is its readable form, ``"<request id>/<index>"``). A later choice
    with ``parent`` (choice 0) set shares the prompt: until it starts, it waits for the parent's full prompt
    blocks (``waits_for_prompt``), and its reservation (``reserve_blocks``) leaves out ``shared_blocks``,
    the blocks it will take from the cache.
    """

    def __init__(
        self, request: EngineRequest, block_size: int, hash_blocks: bool, index: int = 0, parent: Sequence | None = None
    ) -> None:
        self.request_id: str = request.request_id
        self.index = index
        self.seq_id: tuple[str, int] = (request.request_id, index)
        self.token_ids: list[int] = list(request.token_ids)
        self.num_prompt_tokens: int = len(self.token_ids)
        self.num_generated_before: int = min(request.generated_tokens, self.num_prompt_tokens)
        """Trailing prompt tokens a previous worker generated (a migrated request): text at decode positions."""
        self.media: list[MediaSpan] = list(request.media)
        self.sampling: SamplingOptions = choice_sampling(request.sampling, index)
        self.parent = parent
        self.shared_blocks = shared_prompt_blocks(self.num_prompt_tokens, block_size) if parent is not None else 0
        self.cache_salt: str = request.cache_salt
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.prefix_looked_up = False
        self.block_table: list[int] = []
        self.num_registered_blocks = 0
        self.finish_reason: str | None = None
        self.positions: list[list[int]] = []  # M-RoPE rows [3][max tokens], set by the model runner
        self.generator: torch.Generator | None = None
        self.grammar: GrammarState | None = None  # a constrained choice's matcher (structured.py)
        self._hash_blocks = hash_blocks
        self.block_hashes: list[bytes] = []
        self.update_block_hashes()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def name(self) -> str:
        """The request id for choice 0, ``"<request id>/<index>"`` for the others (messages, logs)."""
        return self.request_id if self.index == 0 else f"{self.request_id}/{self.index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most tokens it may generate: what its reservation covers."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def max_num_blocks(self) -> int:
        return -(-self.max_num_tokens // self.block_size)

    @property
    def reserve_blocks(self) -> int:
        """The blocks its reservation covers: all it may hold, less the shared prompt blocks not taken yet
        (``choice_blocks``, the formula of the worker's and the router's admission)."""
        prompt, max_tokens, shares = self.num_prompt_tokens, self.sampling.max_tokens, self.shared_blocks > 0
        return choice_blocks(prompt, max_tokens, self.block_size, self.index, shares)

    def waits_for_prompt(self) -> bool:
        """True while a later choice waits for choice 0 to have the full prompt blocks it shares in the cache."""
        parent = self.parent
        return (
            self.shared_blocks > 0
            and parent is not None
            and not parent.is_finished
            and parent.num_registered_blocks < self.shared_blocks
        )

    def took_shared_prompt(self) -> None:
        """It started (its reservation grew by the shared blocks): from now on an ordinary sequence."""
        self.shared_blocks = 0
        self.parent = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def output_start(self) -> int:
        """Where the output starts in ``token_ids`` for the logits processors: a previous worker's tokens count."""
        return self.num_prompt_tokens - self.num_generated_before

    @functools.cached_property
    def distinct_prompt_ids(self) -> tuple[int, ...]:
        """The distinct ids before ``output_start`` (what a repetition penalty reads of the prompt), once."""
        return tuple(set(self.token_ids[: self.output_start]))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, index: int) -> list[int]:
        """Token ids of block ``index``."""
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def update_block_hashes(self) -> None:
        """Hash the full blocks not hashed yet (no-op without prefix caching)."""
        if self._hash_blocks:
            hashes, size = self.block_hashes, self.block_size
            extend_block_hashes(hashes, self.token_ids, size, self.media, self.cache_salt)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self.update_block_hashes()

    def first_blocked_offset(self, num_computed: int, has_embedding: Container[str]) -> int:
        """How far computation from ``num_computed`` may go: nowhere while its grammar compiles, else up to the
        first media item still needed whose embedding is not in ``has_embedding``, else to the end."""
        if self.grammar is not None and not self.grammar.ready:
            return num_computed
        for item in self.media:
            if item.offset + item.num_tokens > num_computed and item.mm_hash not in has_embedding:
                return max(item.offset, num_computed)
        return self.num_tokens

    def missing_embeddings(self, has_embedding: Container[str]) -> list[str]:
        """Media items not computed yet whose embedding has not arrived."""
        return [
            item.mm_hash
            for item in self.media
            if item.offset + item.num_tokens > self.num_computed_tokens and item.mm_hash not in has_embedding
        ]

    def stop_reason(self, eos_token_ids: frozenset[int]) -> str | None:
        """Why the sequence stops after its last token, or None to go on."""
        last = self.token_ids[-1]
        if not self.sampling.ignore_eos and last in eos_token_ids:
            return "stop"
        if last in self.sampling.stop_token_ids:
            return "stop"
        if len(self.token_ids) - self.num_prompt_tokens >= self.sampling.max_tokens:
            return "length"
        return None

    def reset_for_recompute(self) -> None:
        """After preemption: no blocks, nothing computed; tokens and hashes stay."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING


def choice_sampling(sampling: SamplingOptions, index: int) -> SamplingOptions:
    """Choice ``index``'s sampling: a seeded request's choice i draws from ``seed + i`` (mod 2**64)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**64)


def request_choices(request: EngineRequest, block_size: int, hash_blocks: bool) -> list[Sequence]:
    """The ``sampling.n`` sequences of a request, choice 0 first. With prefix caching (``hash_blocks``) the
    later ones share choice 0's prompt blocks; without it each computes its own prefill. Positions are set
    by the model runner on choice 0; the caller shares them (read-only) with the others."""
    first = Sequence(request, block_size, hash_blocks)
    parent = first if hash_blocks else None
    return [first] + [Sequence(request, block_size, hash_blocks, i, parent) for i in range(1, request.sampling.n)]
