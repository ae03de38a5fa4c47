"""How a language model splits over tensor-parallel ranks: each rank's query and KV heads, MLP columns and
vocabulary rows, or the refusal that says why a size cannot split a model (no torch: `epd plan` reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TENSOR_PARALLEL_SIZE = 8
"""One node's GPUs: the most ranks one worker spans."""


def split(total: int, parts: int) -> list[range]:
    """``range(total)`` cut into ``parts`` contiguous ranges, the first ``total % parts`` one longer (so rank 0
    holds the most)."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class ShardPlan:
    """What each of ``size`` ranks holds of one language model.

    Invariant: ``q_heads[r]`` and ``kv_heads[r]`` are contiguous head ranges; every query head of rank r reads a
    KV head of rank r, ``groups[r]`` query heads per KV head (so attention on a rank is plain GQA over its own
    heads). With at least as many KV heads as ranks they split (uneven counts allowed, rank 0 the most) and each
    query head follows its KV head; with fewer, each KV head is replicated on ``size // kv`` ranks, which split
    its query heads evenly. ``vocab[r]`` are the embedding and LM-head rows of rank r; the MLP's intermediate
    columns split as ``split(intermediate, size)``.
    """

    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    q_heads: tuple[range, ...]
    kv_heads: tuple[range, ...]
    vocab: tuple[range, ...]

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(len(q) // len(kv) for q, kv in zip(self.q_heads, self.kv_heads, strict=True))

    @property
    def max_kv_heads(self) -> int:
        """The most KV heads any rank holds (rank 0's): its KV bytes per token bound every rank's block count."""
        return max(len(kv) for kv in self.kv_heads)

    @property
    def replicated(self) -> bool:
        return self.num_kv_heads < self.size

    @classmethod
    def of_config(cls, config: Any, size: int) -> ShardPlan:
        """The plan for a transformers config (its text config is used) over ``size`` ranks; ValueError naming
        what does not divide when it cannot split."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads, kv = int(text.num_attention_heads), int(text.num_key_value_heads)
        head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
        return cls.of_sizes(heads, kv, head_dim, int(text.vocab_size), size)

    @classmethod
    def of_sizes(cls, heads: int, kv: int, head_dim: int, vocab: int, size: int) -> ShardPlan:
        check_size(size)
        if heads % kv:
            raise ValueError(f"{heads} query heads do not group over {kv} KV heads")
        group = heads // kv
        if size > heads:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's {heads} query heads")
        if kv >= size:
            kv_ranges = split(kv, size)
            q_ranges = [range(r.start * group, r.stop * group) for r in kv_ranges]
        else:
            if size % kv:
                raise ValueError(
                    f"tensor_parallel_size {size} does not divide over the model's {kv} KV heads: with fewer KV "
                    f"heads than ranks each is replicated, so the size must be a multiple of {kv}"
                )
            replicas = size // kv
            if group % replicas:
                raise ValueError(
                    f"tensor_parallel_size {size} cannot split the {group} query heads of each of the model's {kv} "
                    f"KV heads over its {replicas} replicas evenly"
                )
            per_rank = group // replicas
            kv_ranges = [range(r // replicas, r // replicas + 1) for r in range(size)]
            q_ranges = [range(r * per_rank, (r + 1) * per_rank) for r in range(size)]
        return cls(size, heads, kv, head_dim, vocab, tuple(q_ranges), tuple(kv_ranges), tuple(split(vocab, size)))


def check_size(size: int) -> None:
    """ValueError unless ``size`` is a usable tensor-parallel size (1 to ``MAX_TENSOR_PARALLEL_SIZE``)."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(f"tensor_parallel_size must be within 1..{MAX_TENSOR_PARALLEL_SIZE}, got {size}")
