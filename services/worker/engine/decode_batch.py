"""The last decode-only step, kept and advanced in place while the same sequences decode on (the host half of vLLM's
persistent input batch).

Most steps of a busy engine decode the sequences of the step before, each one token further. Laying such a step out
afresh writes every row's id, slot, positions and block table (~2,300 ints for 64 rows of ~300 tokens, over 0.1 ms
of Python); advancing the kept one writes the new token ids, adds one to every slot, position and context length,
and writes a block id only where a row began a block, in a numpy buffer the CPU step reads without a copy. A
generated token's positions are its predecessor's plus one on every axis (``ModelAdapter.decode_positions``).
"""

from __future__ import annotations

import numpy as np

from services.worker.engine.attention.backend import AttentionBackend
from services.worker.engine.host_device import packed_ints
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_input import StepInput


class DecodeBatch:
    """The kept step and how to recognise its successor.

    Invariant: when ``step`` is not None its ``ints`` is ``self.ints`` (int64), every row of it is the one-token
    decode of a generated token (no media row; every row samples) of the sequence the scheduler listed at
    ``chunk_of_row[r]`` for row ``r`` (``row_of_chunk`` the inverse), ``starts[r]`` is that row's token index,
    and ``step.layout`` is the backend's for those rows. ``_seqs`` and ``_next`` list, in the scheduler's order,
    the sequences and token indexes the next step must have to be this one advanced.
    """

    def __init__(self, block_size: int, backend: AttentionBackend) -> None:
        self.block_size = block_size
        self.backend = backend
        self.step: StepInput | None = None
        self.ints = np.zeros(0, dtype=np.int64)
        self.row_of_chunk = np.zeros(0, dtype=np.int64)  # the scheduler's i-th chunk is row row_of_chunk[i]
        self.chunk_of_row: list[int] = []
        self.starts = np.zeros(0, dtype=np.int64)  # row order
        self._seqs: list[Sequence] = []  # scheduler order
        self._next: list[int] = []  # the token index each decodes next, scheduler order
        self.advanced = 0
        """Steps advanced in place (a test reads it)."""

    def keep(self, step: StepInput, chunks: list[ScheduledChunk]) -> StepInput:
        """``step`` (built from ``chunks``, closed) with its ints in a numpy buffer, kept when it qualifies (a
        decode of a generated token in every row, no padding); otherwise forgets the kept step and returns
        ``step`` as it was."""
        rows = step.rows
        qualifies = step.padding is None and step.decode_only and len(step.sample_rows) == len(rows) == len(chunks)
        if not qualifies or not all(c.start >= c.seq.num_prompt_tokens for c in rows):
            self.step = None
            return step
        self.ints = step.ints = packed_ints(step.ints)  # type: ignore[assignment]
        row_of = {id(c.seq): r for r, c in enumerate(rows)}
        self.row_of_chunk = np.array([row_of[id(c.seq)] for c in chunks], dtype=np.int64)
        chunk_of = {id(c.seq): i for i, c in enumerate(chunks)}
        self.chunk_of_row = [chunk_of[id(c.seq)] for c in rows]
        self.starts = np.array([c.start for c in rows], dtype=np.int64)
        self._seqs = [c.seq for c in chunks]
        self._next = [c.start + 1 for c in chunks]
        self.step = step
        return step

    def forget(self) -> None:
        """Keep nothing (a step ran another way)."""
        self.step = None

    def advance(self, chunks: list[ScheduledChunk]) -> StepInput | None:
        """The kept step advanced to ``chunks`` in place, or None (the kept step forgotten) when ``chunks`` are not
        its sequences, in its order, each one token further, or the backend cannot advance its metadata."""
        step = self.step
        if step is None:
            return None
        starts = [c.start for c in chunks]
        if starts != self._next or [c.seq for c in chunks] != self._seqs:
            self.step = None
            return None
        n, size, ints = step.num_tokens, self.block_size, self.ints
        self.starts += 1
        began = []  # (row, block index, block id) of the rows whose token starts a block
        for r in np.flatnonzero(self.starts % size == 0).tolist():
            seq = chunks[self.chunk_of_row[r]].seq
            index = int(self.starts[r]) // size
            began.append((r, index, seq.block_table[index]))
        if not self.backend.advance(step, ints, began):
            self.step = None
            return None
        ints[self.row_of_chunk] = [c.seq.token_ids[c.start] for c in chunks]
        ints[n : 2 * n] += 1
        for r, _, block_id in began:
            ints[n + r] = block_id * size
        ints[2 * n : 5 * n] += 1
        step.rows = step.sampled = [chunks[i] for i in self.chunk_of_row]
        step.max_context += 1
        self._next = [s + 1 for s in starts]
        self.advanced += 1
        return step
