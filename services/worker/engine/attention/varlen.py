"""The step metadata and attention call shared by `flash` and `flash-reference`: one varlen call per layer.

Both backends lay out the same metadata here and make the same call; only the function differs (torch's
FlashAttention kernel, or its pure-torch twin in services/models/varlen_attention.py), so what the CPU
tests run is what the GPU runs. Per step, for the ``N`` rows (sequences, padded rows included):
``cu_seq_q`` (cumulative query lengths), ``cu_seq_k`` (cumulative context lengths), ``seqused_k``
(context lengths) and ``block_table [N, width]`` (padded with block 0, or the scratch block for padded
rows), one int32 run in the packed ints; the slot mapping is the step's KV slots. Every decode and chunk
of the step goes through one call per layer: no gathers, no masks (causality is bottom-right aligned).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from services.models.varlen_attention import VarlenFn
from services.worker.engine.attention.kv_cache import PAGED, KVCache
from services.worker.engine.step_input import StepInput, extend_table

CAUSAL = (-1, 0)
FULL = (-1, -1)


@dataclass(frozen=True, slots=True)
class VarlenLayout:
    """``ints[meta_at : meta_at + 3 * num_seqs + 2 + num_seqs * width]`` holds, in order, ``cu_seq_q [N+1]``,
    ``cu_seq_k [N+1]``, ``seqused_k [N]`` and the row-major ``block_table [N, width]``; ``max_q``/``max_k``
    bound the query and context lengths (host integers: the kernel's launch shape)."""

    num_seqs: int
    width: int
    meta_at: int
    max_q: int
    max_k: int

    @property
    def size(self) -> int:
        return 3 * self.num_seqs + 2 + self.num_seqs * self.width


def lay_out_varlen(step: StepInput, block_size: int, table_width: int | None = None) -> None:
    """Append the varlen metadata of ``step.rows`` and its padded rows; ``table_width`` fixes the table width
    and sets ``max_k`` to what it can hold (a graph's fixed launch shape), else both fit the step."""
    rows, padding = step.rows, step.padding
    pad = padding.count if padding is not None else 0
    q_lens = [c.num_tokens for c in rows] + [1] * pad
    contexts = [c.start + c.num_tokens for c in rows] + [1] * pad
    width = table_width if table_width is not None else max(-(-n // block_size) for n in contexts)
    ints = step.ints
    meta_at = len(ints)
    ints.append(0)
    ints.extend(accumulate(q_lens))
    ints.append(0)
    ints.extend(accumulate(contexts))
    ints.extend(contexts)
    for chunk in rows:
        extend_table(ints, chunk.seq.block_table, width)
    if padding is not None:
        ints.extend([padding.scratch_block] * (pad * width))
    max_k = width * block_size if table_width is not None else max(contexts)
    step.layout = VarlenLayout(len(q_lens), width, meta_at, max(q_lens), max_k)


def advance_varlen(step: StepInput, ints: np.ndarray, began: list[tuple[int, int, int]]) -> bool:
    """Advance the metadata of a kept decode-only ``step`` (no padded rows) by one token a row in ``ints`` (its packed
    ints): each context length one more (and the cumulative ones), ``max_k`` with them, and block ``block_id`` at
    index ``index`` of row ``row``'s table for each ``(row, index, block_id)`` in ``began``. False, with nothing
    written, when such a block falls outside the table's width (the step is laid out afresh then)."""
    layout: VarlenLayout = step.layout
    seqs, width, at = layout.num_seqs, layout.width, layout.meta_at
    if step.padding is not None or any(index >= width for _, index, _ in began):
        return False
    ints[at + seqs + 2 : at + 2 * seqs + 2] += np.arange(1, seqs + 1)  # cu_seq_k
    ints[at + 2 * seqs + 2 : at + 3 * seqs + 2] += 1  # seqused_k
    table_at = at + 3 * seqs + 2
    for row, index, block_id in began:
        ints[table_at + row * width + index] = block_id
    step.layout = dataclasses.replace(layout, max_k=layout.max_k + 1)
    return True


@dataclass
class VarlenContext:
    """One step of a varlen backend: K/V written through ``slot_mapping`` into the page pool, then one
    ``attention`` call (``varlen_attn``'s signature) per layer."""

    kv: KVCache
    slot_mapping: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_k: int
    attention: VarlenFn

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        k_pool, v_pool = self.kv.keys[layer], self.kv.values[layer]  # [blocks, size, Hkv, D]
        kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        k_pool.view(-1, kv_heads, head_dim).index_copy_(0, self.slot_mapping, key.transpose(0, 1).to(k_pool.dtype))
        v_pool.view(-1, kv_heads, head_dim).index_copy_(0, self.slot_mapping, value.transpose(0, 1).to(v_pool.dtype))
        # one query per row, the last of its context: causal is full attention, and (-1, -1) lets FlashAttention
        # fold a KV head's query heads into one pass (its GQA decode path needs both window sides unbounded)
        window = FULL if self.max_q == 1 else CAUSAL
        return self.attention(
            query.transpose(0, 1), k_pool, v_pool, self.cu_seq_q, self.cu_seq_k, self.max_q, self.max_k,
            scale=scaling, window_size=window, enable_gqa=query.shape[0] != kv_heads, seqused_k=self.seqused_k,
            block_table=self.block_table,
        )  # fmt: skip


class VarlenBackend:
    """A paged page-pool backend calling ``attention`` once per layer; decode-only steps can be graphed."""

    name = "varlen"
    kv_layout = PAGED
    supports_graphs = True

    def __init__(self, block_size: int, attention: VarlenFn) -> None:
        self.block_size = block_size
        self.attention = attention

    def lay_out(self, step: StepInput, table_width: int | None = None) -> None:
        lay_out_varlen(step, self.block_size, table_width)

    def advance(self, step: StepInput, ints: np.ndarray, began: list[tuple[int, int, int]]) -> bool:
        """In a kept decode-only step (services/worker/engine/decode_batch.py): ``advance_varlen``."""
        return advance_varlen(step, ints, began)

    def context(self, step: StepInput, packed: torch.Tensor, kv: KVCache) -> VarlenContext:
        layout: VarlenLayout = step.layout
        n, seqs = step.num_tokens, layout.num_seqs
        meta = packed[layout.meta_at : layout.meta_at + layout.size].to(torch.int32)
        return VarlenContext(
            kv=kv,
            slot_mapping=packed[n : 2 * n],
            cu_seq_q=meta[: seqs + 1],
            cu_seq_k=meta[seqs + 1 : 2 * seqs + 2],
            seqused_k=meta[2 * seqs + 2 : 3 * seqs + 2],
            block_table=meta[3 * seqs + 2 :].view(seqs, layout.width),
            max_q=layout.max_q,
            max_k=layout.max_k,
            attention=self.attention,
        )
