"""A kept decode step advanced in place holds, row for row, what laying the same step out afresh holds: token id,
slot, positions, context length and block table, for the gathering layouts (one group, and groups cut at least
cost) and the varlen one; a step of other sequences, or of a row past its padded table, is laid out afresh."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engine.attention.cpu_kernel import ONE_GROUP
from services.worker.engine.attention.flash_reference import FlashReferenceBackend
from services.worker.engine.attention.gathered_layout import GatheredLayout
from services.worker.engine.attention.sdpa import SdpaBackend
from services.worker.engine.decode_batch import DecodeBatch
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_input import StepInput, build_step_input

BLOCK = 4


def _backend(kind: str) -> SdpaBackend | FlashReferenceBackend:
    if kind == "varlen":
        return FlashReferenceBackend(BLOCK)
    backend = SdpaBackend(BLOCK, torch.device("cpu"), torch.float32)
    backend.group_cost = ONE_GROUP if kind == "one-group" else 2
    return backend


class _Blocks:
    """Hands out block ids (not in order, as a block manager's free list does)."""

    def __init__(self, seed: int) -> None:
        self.ids = list(range(1, 10_000))
        random.Random(seed).shuffle(self.ids)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK < num_tokens:
            seq.block_table.append(self.ids.pop())


def _decoding(request_id: str, prompt: int, generated: int, blocks: _Blocks) -> Sequence:
    seq = Sequence(EngineRequest(request_id, list(range(3, 3 + prompt)), [], SamplingOptions(max_tokens=10_000)),
                   BLOCK, False)  # fmt: skip
    seq.token_ids += [5] * generated
    seq.positions = [[7 * axis + i for i in range(200)] for axis in range(3)]
    blocks.grow(seq, len(seq.token_ids))
    return seq


def _fresh(chunks: list[ScheduledChunk], backend: SdpaBackend | FlashReferenceBackend) -> StepInput:
    step = build_step_input(chunks, BLOCK, embeddings=None)  # type: ignore[arg-type]  # no media
    backend.lay_out(step)
    step.close()
    return step


def _rows(step: StepInput) -> dict[int, tuple]:
    """Per sequence (by id): token id, slot, three positions, context length and its blocks, read from the ints
    through the step's layout."""
    ints, n, layout = [int(v) for v in step.ints], step.num_tokens, step.layout
    out = {}
    for r, chunk in enumerate(step.rows):
        if isinstance(layout, GatheredLayout):
            lo = 0
            for group in layout.decodes:
                if r < lo + group.num_rows:
                    break
                lo += group.num_rows
            length = ints[group.lengths_at + r - lo]
            table = ints[group.table_at + (r - lo) * group.width :][: group.width]
        else:
            seqs, at = layout.num_seqs, layout.meta_at
            length = ints[at + 2 * seqs + 2 + r]
            assert ints[at + seqs + 2 + r] == sum(ints[at + 2 * seqs + 2 : at + 2 * seqs + 3 + r])  # cu_seq_k
            assert layout.max_k >= length
            table = ints[at + 3 * seqs + 2 + r * layout.width :][: layout.width]
        blocks = table[: -(-length // BLOCK)]
        positions = tuple(ints[(2 + axis) * n + r] for axis in range(3))
        out[id(chunk.seq)] = (ints[r], ints[n + r], positions, length, blocks)
    assert ints[step.sample_at :] == list(range(n))
    return out


@pytest.mark.parametrize("kind", ["one-group", "groups", "varlen"])
@settings(max_examples=25, deadline=None)
@given(
    contexts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=12),
    steps=st.integers(1, 24),
    seed=st.integers(0, 1000),
)
def test_advanced_steps_hold_what_fresh_ones_hold(kind: str, contexts: list[tuple[int, int]], steps: int,
                                                  seed: int) -> None:  # fmt: skip
    backend, blocks = _backend(kind), _Blocks(seed)
    seqs = [_decoding(f"r{i}", prompt, generated, blocks) for i, (prompt, generated) in enumerate(contexts)]
    random.Random(seed).shuffle(seqs)  # the scheduler's order is not the rows' (ascending context)
    batch = DecodeBatch(BLOCK, backend)
    advanced = 0
    for _ in range(steps):
        chunks = [ScheduledChunk(seq, len(seq.token_ids) - 1, 1, True) for seq in seqs]
        for seq in seqs:
            blocks.grow(seq, len(seq.token_ids))
        fresh = _fresh(chunks, backend)
        step = batch.advance(chunks)
        if step is None:
            step = batch.keep(_fresh(chunks, backend), chunks)
        else:
            advanced += 1
        assert isinstance(step.ints, np.ndarray) and step.num_tokens == fresh.num_tokens
        assert _rows(step) == _rows(fresh)
        assert [c.seq for c in step.sampled] == [c.seq for c in fresh.sampled]
        assert step.max_context == fresh.max_context
        for seq in seqs:
            seq.token_ids.append(11 + len(seq.token_ids) % 50)
    if kind != "groups":  # one table as wide as the longest row: only that row outgrows it, once a block
        assert advanced >= steps - 1 - -(-steps // BLOCK)
    assert batch.advanced == advanced


def test_a_step_of_other_sequences_or_of_prompt_tokens_is_laid_out_afresh() -> None:
    backend, blocks = _backend("one-group"), _Blocks(0)
    a, b, c = (_decoding(name, 5, 2, blocks) for name in "abc")  # 7 tokens: block 2 from token 8
    batch = DecodeBatch(BLOCK, backend)

    def step_of(seqs: list[Sequence]) -> StepInput | None:
        chunks = [ScheduledChunk(seq, len(seq.token_ids) - 1, 1, True) for seq in seqs]
        for seq in seqs:
            blocks.grow(seq, len(seq.token_ids))
        step = batch.advance(chunks)
        if step is None:
            batch.keep(_fresh(chunks, backend), chunks)
        for seq in seqs:
            seq.token_ids.append(9)
        return step

    assert step_of([a, b]) is None and step_of([a, b]) is not None
    assert step_of([a, b, c]) is None  # a sequence joined
    assert step_of([b, a, c]) is None  # another order
    assert step_of([b, a, c]) is not None
    assert step_of([b, c]) is None  # one left
    prompt = _decoding("p", 5, 0, blocks)  # its last prompt token: not kept (it may be a media row)
    chunks = [ScheduledChunk(prompt, 4, 1, True)]
    assert batch.keep(_fresh(chunks, backend), chunks) is not None and batch.step is None


def test_a_row_past_its_groups_width_is_laid_out_afresh() -> None:
    """Groups cut at least cost: a row that begins a block past its group's padded width cannot advance."""
    backend, blocks = _backend("groups"), _Blocks(1)
    short, long = _decoding("short", 3, 1, blocks), _decoding("long", 40, 1, blocks)  # 4 and 41 tokens
    seqs = [short, long]
    chunks = [ScheduledChunk(seq, len(seq.token_ids) - 1, 1, True) for seq in seqs]
    batch = DecodeBatch(BLOCK, backend)
    step = batch.keep(_fresh(chunks, backend), chunks)
    assert [g.width for g in step.layout.decodes] == [1, 11]  # the short row alone in a group one block wide
    short.token_ids.append(9)
    long.token_ids.append(9)
    for seq in seqs:
        blocks.grow(seq, len(seq.token_ids))
    chunks = [ScheduledChunk(seq, len(seq.token_ids) - 1, 1, True) for seq in seqs]
    assert batch.advance(chunks) is None and batch.step is None  # the short row's token 4 begins its second block
