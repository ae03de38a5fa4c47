"""One step's model inputs, laid out in plain Python lists (no per-sequence tensor ops).

Every integer the step needs goes into one list, which the model runner turns into one tensor (one
host-to-device copy); the pieces are views of it. This module lays out what every attention backend
needs (token ids, KV slots, M-RoPE positions); the backend appends its own metadata (block tables,
lengths), then the runner appends the rows to sample. ENGINE-FACTS: about 0.24 ms per step from lists
against 0.7 ms with per-sequence tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.models.base import PlacedEmbedding
from services.worker.engine.embeddings import EmbeddingPool
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PaddedRows:
    """Rows added after the real ones so a step has a fixed shape (a decode graph's bucket).

    Each padded row is a one-token query whose K/V goes to ``scratch_slot`` and whose context is that one
    slot, in block ``scratch_block`` (which no sequence ever owns); its outputs are ignored.
    """

    count: int
    scratch_block: int
    scratch_slot: int


@dataclass
class StepInput:
    """The flattened step: decodes first (ascending context), then multi-token chunks in schedule order.

    Invariant: with ``T = num_tokens`` (padded rows included), ``ints[0:T]`` are the token ids,
    ``ints[T:2T]`` the KV slots, ``ints[2T:5T]`` the three M-RoPE position rows; then the attention
    backend's metadata (``layout`` says where); then, from ``sample_at``, the rows whose logits are
    sampled (``sampled[i]`` is row ``ints[sample_at + i]``). ``rows`` are the scheduled chunks in row
    order (``padding`` rows follow them); ``placed`` puts media rows at flat row offsets.
    """

    num_tokens: int
    rows: list[ScheduledChunk]
    sampled: list[ScheduledChunk]
    sample_rows: list[int]
    placed: list[PlacedEmbedding]
    ints: list[int]
    padding: PaddedRows | None = None
    layout: Any = None
    sample_at: int = -1
    num_decodes: int = 0
    max_context: int = 0

    @property
    def decode_only(self) -> bool:
        """Every row is one token (decodes, or prefill advancing one token)."""
        return self.num_decodes == len(self.rows)

    def close(self) -> None:
        """Append the sample rows (after the backend's metadata): the ints are complete."""
        self.sample_at = len(self.ints)
        self.ints.extend(self.sample_rows)


def build_step_input(
    chunks: list[ScheduledChunk], block_size: int, embeddings: EmbeddingPool, padding: PaddedRows | None = None
) -> StepInput:
    """Lay out ids, slots and positions of ``chunks`` (each sequence's ``positions`` must be set), and
    ``padding`` rows after them when given (only for steps of one-token rows)."""
    decodes = sorted((c for c in chunks if c.num_tokens == 1), key=_start)
    prefills = [c for c in chunks if c.num_tokens > 1]
    if padding is not None and prefills:
        raise ValueError("padded rows are only for steps of one-token rows")
    ids: list[int] = []
    slots: list[int] = []
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    placed: list[PlacedEmbedding] = []
    sample_rows: list[int] = []
    sampled: list[ScheduledChunk] = []
    size = block_size
    for chunk in decodes:
        seq, i = chunk.seq, chunk.start
        if seq.media and i < seq.num_prompt_tokens:  # a generated token is never media
            placed.extend(_placed_rows(seq, i, i + 1, len(ids), embeddings))
        ids.append(seq.token_ids[i])
        slots.append(seq.block_table[i // size] * size + i % size)
        pos = seq.positions
        rows[0].append(pos[0][i])
        rows[1].append(pos[1][i])
        rows[2].append(pos[2][i])
        if chunk.samples:
            sample_rows.append(len(ids) - 1)
            sampled.append(chunk)
    for chunk in prefills:
        seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
        if seq.media:
            placed.extend(_placed_rows(seq, start, end, len(ids), embeddings))
        table = seq.block_table
        ids.extend(seq.token_ids[start:end])
        slots.extend(table[i // size] * size + i % size for i in range(start, end))
        for axis in range(3):
            rows[axis].extend(seq.positions[axis][start:end])
        if chunk.samples:
            sample_rows.append(len(ids) - 1)
            sampled.append(chunk)
    if padding is not None:
        ids.extend([0] * padding.count)
        slots.extend([padding.scratch_slot] * padding.count)
        for axis in range(3):
            rows[axis].extend([0] * padding.count)
    ordered = decodes + prefills
    return StepInput(
        num_tokens=len(ids),
        rows=ordered,
        sampled=sampled,
        sample_rows=sample_rows,
        placed=placed,
        ints=ids + slots + rows[0] + rows[1] + rows[2],
        padding=padding,
        num_decodes=len(decodes),
        max_context=max((c.start + c.num_tokens for c in ordered), default=0),
    )


def extend_table(ints: list[int], table: list[int], width: int, pad: int = 0) -> None:
    """Append ``table`` cut or padded (with ``pad``) to exactly ``width`` block ids."""
    if len(table) >= width:
        ints.extend(table[:width])
    else:
        ints.extend(table)
        ints.extend([pad] * (width - len(table)))


def _start(chunk: ScheduledChunk) -> int:
    return chunk.start


def _placed_rows(seq: Sequence, start: int, end: int, row: int, embeddings: EmbeddingPool) -> list[PlacedEmbedding]:
    """The media rows of tokens ``[start, end)`` of ``seq``, placed at flat row ``row`` onwards."""
    placed = []
    for item in seq.media:
        lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
        if lo < hi:
            first = item.item_row - item.offset  # the embedding row of token i is i + first
            rows = embeddings.get(item.mm_hash)[lo + first : hi + first]
            placed.append(PlacedEmbedding(row + lo - start, rows))
    return placed
