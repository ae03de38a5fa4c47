"""Step input layout: the packed ints hold what the invariant says; decode groups cut at least cost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_input import build_step_input, split_points

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
    n, ints = step.num_tokens, step.ints
    assert n == 7 and [c.seq.request_id for c in step.sampled] == ["b", "a", "c"]
    assert ints[:n] == [short.token_ids[2], long.token_ids[9], *chunked.token_ids[4:9]]
    chunk_slots = [21 * BLOCK + k for k in range(4)] + [22 * BLOCK]
    assert ints[n : 2 * n] == [10 * BLOCK + 2, 2 * BLOCK + 1, *chunk_slots]
    assert ints[2 * n : 3 * n] == [2, 9, 4, 5, 6, 7, 8] and ints[4 * n : 5 * n] == [202, 209, 204, 205, 206, 207, 208]
    assert ints[5 * n : 5 * n + 3] == [0, 1, 6]
    rows = sum(g.num_rows for g in step.decodes)
    assert rows == 2
    for g in step.decodes:
        assert len(ints[g.table_at : g.table_at + g.num_rows * g.width]) == g.num_rows * g.width
    (chunk,) = step.chunks
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
