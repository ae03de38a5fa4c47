"""The step metadata of the gathering backends (`sdpa`, `cpu-kernel`): decodes in padded groups, chunks alone.

Decodes (one-token rows, ascending context) are cut into groups whose block tables are padded to one
width (one SDPA call per group; the kernel makes one group); each multi-token chunk lists its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.step_input import StepInput, extend_table

GROUP_COST_BLOCKS = 48
"""What one more padded decode group costs (an SDPA call and two gathers), in padded block-rows."""


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """``num_rows`` consecutive single-token queries padded to ``width`` blocks.

    ``ints[table_at : table_at + num_rows * width]`` is the row-major block table (padded with block 0),
    ``ints[lengths_at : lengths_at + num_rows]`` the context lengths.
    """

    num_rows: int
    width: int
    table_at: int
    lengths_at: int


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """A multi-token chunk: rows ``[query_start, query_start + query_len)`` of the step.

    Its context is ``context_len`` tokens (``query_len`` when nothing was cached before it: ``fresh``), held in
    ``num_blocks`` blocks whose ids are ``ints[blocks_at : blocks_at + num_blocks]``.
    """

    query_start: int
    query_len: int
    context_len: int
    blocks_at: int
    num_blocks: int

    @property
    def fresh(self) -> bool:
        """Nothing was cached before the chunk: its own K/V is its whole context."""
        return self.context_len == self.query_len


@dataclass
class GatheredLayout:
    decodes: list[DecodeRows] = field(default_factory=list)
    chunks: list[ChunkRows] = field(default_factory=list)


def lay_out_gathered(step: StepInput, block_size: int, group_cost: int = GROUP_COST_BLOCKS) -> None:
    """Append decode groups (cut by ``split_points`` with ``group_cost``) and chunk block lists to ``step``."""
    if step.padding is not None:
        raise ValueError("the gathering backends take no padded rows")
    layout = GatheredLayout()
    decodes, prefills = step.rows[: step.num_decodes], step.rows[step.num_decodes :]
    _add_decode_groups(step.ints, layout, decodes, block_size, group_cost)
    _add_chunks(step.ints, layout, prefills, len(decodes), block_size)
    step.layout = layout


def _add_decode_groups(
    ints: list[int], layout: GatheredLayout, decodes: list[ScheduledChunk], size: int, group_cost: int
) -> None:
    lengths = [c.start + 1 for c in decodes]  # ascending
    widths = [-(-n // size) for n in lengths]
    lo = 0
    for hi in split_points(widths, group_cost):
        width, table_at = widths[hi - 1], len(ints)
        for chunk in decodes[lo:hi]:
            extend_table(ints, chunk.seq.block_table, width)
        layout.decodes.append(DecodeRows(hi - lo, width, table_at, len(ints)))
        ints.extend(lengths[lo:hi])
        lo = hi


def _add_chunks(
    ints: list[int], layout: GatheredLayout, prefills: list[ScheduledChunk], query_start: int, size: int
) -> None:
    for chunk in prefills:
        context_len = chunk.start + chunk.num_tokens
        num_blocks = -(-context_len // size)
        layout.chunks.append(ChunkRows(query_start, chunk.num_tokens, context_len, len(ints), num_blocks))
        ints.extend(chunk.seq.block_table[:num_blocks])
        query_start += chunk.num_tokens


def split_points(widths: list[int], group_cost: int = GROUP_COST_BLOCKS, max_cuts: int = 8) -> list[int]:
    """Ends of the padded groups that cut ascending context ``widths`` (in blocks) at least cost.

    A group of rows ``[lo, hi)`` costs ``(hi - lo) * widths[hi - 1]`` padded block-rows plus
    ``group_cost``. Dynamic programming over the cut points, which are only where the width changes
    (cutting inside a run of equal widths never helps), at most ``max_cuts`` of them evenly spread so a
    step pays microseconds for it; none when ``group_cost`` alone outweighs one group's padding (the
    `cpu-kernel` backend's one group). The last end is ``len(widths)``; empty for no rows.
    """
    if not widths:
        return []
    if group_cost >= len(widths) * widths[-1]:
        return [len(widths)]  # k >= 2 groups cost at least 2 x group_cost >= one group's cost: one group
    ends = [i for i in range(1, len(widths)) if widths[i] != widths[i - 1]]
    if len(ends) > max_cuts:
        ends = [ends[(k * len(ends)) // max_cuts] for k in range(max_cuts)]
    ends.append(len(widths))
    best = {0: 0}  # least cost of rows [0, end)
    cut = {0: 0}
    starts = [0]
    for hi in ends:
        width = widths[hi - 1]
        best_cost, best_lo = -1, 0
        for lo in starts:
            cost = best[lo] + (hi - lo) * width + group_cost
            if best_cost < 0 or cost < best_cost:
                best_cost, best_lo = cost, lo
        best[hi], cut[hi] = best_cost, best_lo
        starts.append(hi)
    out = []
    hi = len(widths)
    while hi > 0:
        out.append(hi)
        hi = cut[hi]
    return out[::-1]


def advance_gathered(step: StepInput, ints: np.ndarray, began: list[tuple[int, int, int]]) -> bool:
    """Advance the decode groups of a kept decode-only ``step`` by one token a row in ``ints`` (its packed ints):
    every context length one more, and block ``block_id`` at index ``index`` of row ``row``'s table for each
    ``(row, index, block_id)`` in ``began`` (the rows whose token starts a block). False, with nothing written,
    when such a block falls outside its group's padded width (the step is laid out afresh then)."""
    layout: GatheredLayout = step.layout
    writes, lo, groups = [], 0, iter(layout.decodes)
    group = next(groups, None)
    for row, index, block_id in began:  # rows ascending
        while group is not None and row >= lo + group.num_rows:
            lo += group.num_rows
            group = next(groups, None)
        if group is None or index >= group.width:
            return False
        writes.append((group.table_at + (row - lo) * group.width + index, block_id))
    for group in layout.decodes:
        ints[group.lengths_at : group.lengths_at + group.num_rows] += 1
    for at, block_id in writes:
        ints[at] = block_id
    return True
