"""The `sdpa` backend: attention over blocks gathered into contiguous tensors, with torch's SDPA.

Decodes go in padded groups, one SDPA call per group over its gathered blocks with an additive mask;
a multi-token chunk is one SDPA call, plain causal when nothing was cached before it, else over its
gathered context with a bottom-right causal mask. KV head-major (`kv_cache.HEAD_MAJOR`). Runs anywhere
torch runs; the `cpu-kernel` backend (cpu_kernel.py) is this one with decodes, bfloat16 chunks with nothing cached
before them and short chunks after a cached context through the compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.engine.attention.gathered_layout import (
    GROUP_COST_BLOCKS,
    GatheredLayout,
    advance_gathered,
    lay_out_gathered,
)
from services.worker.engine.attention.kv_cache import DIM_MAJOR_KEYS, HEAD_MAJOR, KVCache
from services.worker.engine.decode_kernel import DecodeKernel
from services.worker.engine.step_input import StepInput


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A multi-token chunk: rows ``[query_start, query_start + query_len)``; its context in blocks.

    ``block_ids`` is None when nothing is cached before the chunk (its own K/V is the context; plain
    causal); otherwise ``mask [query_len, context_len]`` (additive: 0 or -inf) is bottom-right causal. In the
    decode kernel's form (``lengths`` set, no mask) each query row is a decode of its own: ``block_ids`` holds
    the chunk's blocks once per row (``[query_len * blocks]``) and ``lengths [query_len]`` each row's context
    (its own token the last).
    """

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None
    lengths: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Consecutive single-token queries whose block tables are padded to one width of ``blocks`` blocks.

    ``mask`` is built only for SDPA (the kernel reads ``lengths``).
    """

    num_rows: int
    block_ids: torch.Tensor  # [rows * blocks], row-major, padded with block 0
    lengths: torch.Tensor  # [rows] context lengths
    mask: torch.Tensor | None  # [rows, 1, 1, blocks * size] additive: 0 inside the context, -inf past it


class SdpaBackend:
    """Gathered blocks and SDPA; decode groups cut at ``group_cost`` (services/.../gathered_layout.py)."""

    name = "sdpa"
    kv_layout = HEAD_MAJOR
    supports_graphs = False
    group_cost = GROUP_COST_BLOCKS
    decode_kernel: DecodeKernel | None = None
    kernel_chunk_work = 0
    """Chunks after a cached context whose query x context length is at most this go through ``decode_kernel``,
    a row each."""
    kernel_fresh_chunks = False
    """Chunks with nothing cached before them go through ``decode_kernel``, a row each."""

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.block_size = block_size
        self.device = device
        self._arange = torch.arange(1024, device=device)
        self._zero = torch.zeros((), dtype=dtype, device=device)
        self._minus_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        self._offsets: torch.Tensor | None = None

    def lay_out(self, step: StepInput, table_width: int | None = None) -> None:
        lay_out_gathered(step, self.block_size, self.group_cost)

    def advance(self, step: StepInput, ints: np.ndarray, began: list[tuple[int, int, int]]) -> bool:
        """In a kept decode-only step (services/worker/engine/decode_batch.py): ``advance_gathered``."""
        return advance_gathered(step, ints, began)

    def context(self, step: StepInput, packed: torch.Tensor, kv: KVCache) -> GatheredContext:
        """Decode groups and chunk spans as views of ``packed``; masks built once for all layers."""
        layout: GatheredLayout = step.layout
        size, n = self.block_size, step.num_tokens
        # one past the longest context: a chunk in the kernel's form reads lengths up to context_len inclusive
        span = self._span(max([g.width * size for g in layout.decodes] + [c.context_len + 1 for c in layout.chunks]))
        groups = []
        for g in layout.decodes:
            block_ids = packed[g.table_at : g.table_at + g.num_rows * g.width]
            lengths = packed[g.lengths_at : g.lengths_at + g.num_rows]
            mask = None
            if self.decode_kernel is None:
                mask = self._additive(span[: g.width * size][None, :] < lengths[:, None])[:, None, None, :]
            groups.append(DecodeGroup(g.num_rows, block_ids, lengths, mask))
        spans = []
        for c in layout.chunks:
            block_ids = packed[c.blocks_at : c.blocks_at + c.num_blocks]
            first = c.context_len - c.query_len  # the chunk's first token's index in its context
            if self.kernel_fresh_chunks if c.fresh else c.query_len * c.context_len <= self.kernel_chunk_work:
                lengths = span[first + 1 : c.context_len + 1]
                spans.append(ChunkSpan(c.query_start, c.query_len, c.context_len, block_ids.repeat(c.query_len),
                                       None, lengths))  # fmt: skip
                continue
            if c.fresh:
                spans.append(ChunkSpan(c.query_start, c.query_len, c.context_len, None, None))
                continue
            inside = span[: c.context_len][None, :] <= span[first : c.context_len][:, None]
            spans.append(ChunkSpan(c.query_start, c.query_len, c.context_len, block_ids, self._additive(inside)))
        slots = packed[n : 2 * n]
        key_slots = (
            _key_slots(slots, size, self._dim_offsets(kv.keys[0].shape[2])) if kv.layout == DIM_MAJOR_KEYS else None
        )
        return GatheredContext(kv, slots, key_slots, groups, spans, self.decode_kernel)

    def _additive(self, inside: torch.Tensor) -> torch.Tensor:
        """0 where ``inside``, -inf elsewhere: built once per step (SDPA converts a bool mask per call)."""
        return torch.where(inside, self._zero, self._minus_inf)

    def _dim_offsets(self, head_dim: int) -> torch.Tensor:
        """``arange(head_dim) * block_size`` on the device (with dim-major keys, dim d of a token is ``d`` blocks
        of tokens further on), made once."""
        offsets = self._offsets
        if offsets is None or offsets.shape[0] != head_dim:
            offsets = self._offsets = torch.arange(head_dim, device=self.device) * self.block_size
        return offsets

    def _span(self, length: int) -> torch.Tensor:
        """``arange(length)`` or longer, on the device; grown by doubling, reused across steps."""
        if self._arange.shape[0] < length:
            self._arange = torch.arange(max(length, 2 * self._arange.shape[0]), device=self.device)
        return self._arange


@dataclass
class GatheredContext:
    """One step of the gathering backends. Rows are the decode groups' queries in order, then the chunks'.

    ``key_slots`` (dim-major keys only) are the flat indices of the step's slots in one head's keys, dim by dim.
    """

    kv: KVCache
    slot_mapping: torch.Tensor
    key_slots: torch.Tensor | None
    decodes: list[DecodeGroup]
    chunks: list[ChunkSpan]
    decode_kernel: DecodeKernel | None = None

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv.keys[layer], self.kv.values[layer]
        dim_major = self.key_slots is not None
        if dim_major:
            heads = k_cache.shape[0]
            k_cache.view(heads, -1).index_copy_(1, self.key_slots, key.reshape(heads, -1).to(k_cache.dtype))
        else:
            _write_slots(k_cache, key, self.slot_mapping)
        _write_slots(v_cache, value, self.slot_mapping)
        parts = []
        row = 0
        for group in self.decodes:
            rows_q = query[:, row : row + group.num_rows]
            if self.decode_kernel is not None:
                parts.append(self.decode_kernel(rows_q, k_cache, v_cache, group.block_ids, group.lengths, scaling))
            else:
                parts.append(_decode_attention(rows_q, k_cache, v_cache, group, scaling))
            row += group.num_rows
        for chunk in self.chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.lengths is not None:  # each row a decode: the kernel reads the blocks in place
                parts.append(
                    self.decode_kernel(query[:, rows], k_cache, v_cache, chunk.block_ids, chunk.lengths, scaling)
                )
                continue
            if chunk.block_ids is None:  # nothing cached before it: this step's K/V is the context
                keys, values = key[:, rows], value[:, rows]
            else:
                keys = _gather_keys(k_cache, chunk.block_ids, dim_major)[:, : chunk.context_len]
                values = _gather(v_cache, chunk.block_ids)[:, : chunk.context_len]
            parts.append(chunk_attention(query[:, rows], keys, values, chunk.mask, scaling))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _key_slots(slots: torch.Tensor, block_size: int, offsets: torch.Tensor) -> torch.Tensor:
    """With dim-major keys, the flat indices in one head's keys of token slots ``slots [T]``, dim by dim (``[T*D]``;
    ``offsets``: ``arange(D) * block_size``). Slot ``s`` of block ``b = s // size`` sits at ``b * D * size + s % size``,
    i.e. ``s + b * (D - 1) * size``: three tensor calls a step (the layers share the result)."""
    blocks = slots.div(block_size, rounding_mode="floor")
    base = slots.add(blocks, alpha=(offsets.shape[0] - 1) * block_size)
    return (base[:, None] + offsets).view(-1)


def _write_slots(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``rows [Hkv, T, D]`` at flat slot indices ``slots [T]`` of ``cache [Hkv, blocks, size, D]``."""
    heads, _, _, head_dim = cache.shape
    cache.view(heads, -1, head_dim).index_copy_(1, slots, rows.to(cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks ``block_ids [n]`` of ``cache [Hkv, blocks, size, D]`` as ``[Hkv, n * size, D]``."""
    return cache.index_select(1, block_ids).flatten(1, 2)


def _gather_keys(cache: torch.Tensor, block_ids: torch.Tensor, dim_major: bool) -> torch.Tensor:
    """Whole blocks ``block_ids [n]`` of a keys tensor as ``[Hkv, n * size, D]``."""
    if not dim_major:
        return _gather(cache, block_ids)
    return cache.index_select(1, block_ids).transpose(2, 3).flatten(1, 2)  # a copy: [Hkv, n, size, D] to rows


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scaling: float
) -> torch.Tensor:
    """Single-token queries ``[H, B, D]`` against their padded contexts; returns ``[B, H, D]``.

    The query heads sharing a KV head ride on the query-length axis, so no K/V is repeated. Keys are
    head-major here: they are dim-major only with the kernel.
    """
    batch, heads, head_dim = group.num_rows, q.shape[0], q.shape[2]
    kv_heads = k_cache.shape[0]
    keys = _gather(k_cache, group.block_ids).view(kv_heads, batch, -1, head_dim).transpose(0, 1)
    values = _gather(v_cache, group.block_ids).view(kv_heads, batch, -1, head_dim).transpose(0, 1)
    query = q.transpose(0, 1).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask, scale=scaling)
    return out.reshape(batch, heads, head_dim)


def chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """A chunk's queries ``[H, q, D]`` over its context ``[Hkv, ctx, D]``, bottom-right causal; ``[q, H, D]``.

    ``mask`` None means plain causal (query and context are the same tokens). Inputs get a batch axis:
    4-D inputs take torch's fused CPU kernel, 3-D ones its slow reference path.
    """
    out = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )
    return out[0].transpose(0, 1)
