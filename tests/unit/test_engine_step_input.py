"""Step input layout: the packed ints hold what the invariant says, for the gathering backends (decode groups cut
at least cost) and the varlen ones (one block table, padded rows for the decode graphs)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.worker.engine.attention.gathered_layout import lay_out_gathered, split_points
from services.worker.engine.attention.varlen import lay_out_varlen
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_input import PaddedRows, build_step_input

BLOCK = 4


def _seq(request_id: str, num_tokens: int, first_block: int) -> Sequence:
    seq = Sequence(EngineRequest(request_id, list(range(7, 7 + num_tokens)), [], SamplingOptions()), BLOCK, False)
    seq.block_table = list(range(first_block, first_block + -(-num_tokens // BLOCK)))
    seq.positions = [[100 * axis + i for i in range(num_tokens)] for axis in range(3)]
    return seq


def test_layout_decodes_by_context_then_chunks() -> None:
    long, short, chunked = _seq("a", 10, 0), _seq("b", 3, 10), _seq("c", 9, 20)
    chunks = [
        ScheduledChunk(long, 9, 1, True),
        ScheduledChunk(chunked, 4, 5, True),
        ScheduledChunk(short, 2, 1, True),
    ]
    step = build_step_input(chunks, BLOCK, embeddings=None)  # type: ignore[arg-type]  # no media
    lay_out_gathered(step, BLOCK)
    step.close()
    n, ints = step.num_tokens, step.ints
    assert n == 7 and [c.seq.request_id for c in step.sampled] == ["b", "a", "c"]
    assert ints[:n] == [short.token_ids[2], long.token_ids[9], *chunked.token_ids[4:9]]
    chunk_slots = [21 * BLOCK + k for k in range(4)] + [22 * BLOCK]
    assert ints[n : 2 * n] == [10 * BLOCK + 2, 2 * BLOCK + 1, *chunk_slots]
    assert ints[2 * n : 3 * n] == [2, 9, 4, 5, 6, 7, 8] and ints[4 * n : 5 * n] == [202, 209, 204, 205, 206, 207, 208]
    assert ints[step.sample_at :] == [0, 1, 6]
    rows = sum(g.num_rows for g in step.layout.decodes)
    assert rows == 2
    for g in step.layout.decodes:
        assert len(ints[g.table_at : g.table_at + g.num_rows * g.width]) == g.num_rows * g.width
    (chunk,) = step.layout.chunks
    assert (chunk.query_start, chunk.query_len, chunk.context_len, chunk.num_blocks) == (2, 5, 9, 3)
    assert ints[chunk.blocks_at : chunk.blocks_at + 3] == [20, 21, 22]


@given(st.lists(st.integers(1, 60), max_size=40), st.integers(0, 100))
def test_split_points_cover_rows_and_never_cost_more_than_one_group(widths: list[int], group_cost: int) -> None:
    widths.sort()
    ends = split_points(widths, group_cost)
    if not widths:
        assert ends == []
        return
    assert ends[-1] == len(widths) and ends == sorted(set(ends)) and ends[0] > 0
    cost, lo = 0, 0
    for hi in ends:
        cost += (hi - lo) * widths[hi - 1] + group_cost
        lo = hi
    assert cost <= len(widths) * widths[-1] + group_cost


def test_varlen_layout_one_table_for_decodes_and_chunks() -> None:
    long, short, chunked = _seq("a", 10, 0), _seq("b", 3, 10), _seq("c", 9, 20)
    chunks = [ScheduledChunk(long, 9, 1, True), ScheduledChunk(chunked, 4, 5, False), ScheduledChunk(short, 2, 1, True)]
    step = build_step_input(chunks, BLOCK, embeddings=None)  # type: ignore[arg-type]
    lay_out_varlen(step, BLOCK)
    step.close()
    layout, ints = step.layout, step.ints
    assert (layout.num_seqs, layout.width, layout.max_q, layout.max_k) == (3, 3, 5, 10)
    meta = ints[layout.meta_at : layout.meta_at + layout.size]
    assert meta[:4] == [0, 1, 2, 7]  # cu_seq_q: short, long, then the chunk
    assert meta[4:8] == [0, 3, 13, 22] and meta[8:11] == [3, 10, 9]  # cu_seq_k, seqused_k
    assert meta[11:] == [10, 0, 0, 0, 1, 2, 20, 21, 22]  # tables padded with block 0 to the widest
    assert ints[step.sample_at :] == [0, 1]  # the chunk does not sample


def test_varlen_padded_rows_and_fixed_width() -> None:
    """A decode graph's step: padded rows point at the scratch block; the width and max_k are fixed."""
    seqs = [_seq("a", 10, 0), _seq("b", 3, 10)]
    padding = PaddedRows(2, scratch_block=99, scratch_slot=99 * BLOCK)
    step = build_step_input([ScheduledChunk(s, s.num_tokens - 1, 1, True) for s in seqs], BLOCK, None, padding)  # type: ignore[arg-type]
    lay_out_varlen(step, BLOCK, table_width=6)
    step.close()
    n, layout, ints = step.num_tokens, step.layout, step.ints
    assert n == 4 and ints[n + 2 : 2 * n] == [99 * BLOCK] * 2 and ints[2:4] == [0, 0]
    assert (layout.num_seqs, layout.width, layout.max_q, layout.max_k) == (4, 6, 1, 24)
    meta = ints[layout.meta_at : layout.meta_at + layout.size]
    assert meta[:5] == [0, 1, 2, 3, 4] and meta[10:14] == [3, 10, 1, 1]
    assert meta[14:] == [10, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0] + [99] * 12
    other = build_step_input([ScheduledChunk(seqs[0], 9, 1, True)], BLOCK, None, PaddedRows(3, 99, 99 * BLOCK))  # type: ignore[arg-type]
    lay_out_varlen(other, BLOCK, table_width=6)
    assert other.layout == layout  # same bucket, same offsets: what a captured graph reads
