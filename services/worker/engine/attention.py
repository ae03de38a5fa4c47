"""Our attention over paged KV, plugged into transformers through its attention interface.

The language model runs on one flattened row of all scheduled tokens. Each layer's attention call
writes this step's K/V into the sequences' slots, then attends: single-token queries (decodes) through
the compiled CPU kernel over their blocks in place (``decode_kernel``) or, without it, one padded SDPA
call per group over their gathered blocks; multi-token chunks one SDPA call each with a bottom-right
causal mask (the chunk's queries are the last tokens of the context). Row order is decodes first,
then chunks, so the output is one concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.worker.engine.decode_kernel import DecodeKernel

ATTENTION_NAME = "epd_paged"
CONTEXT_KWARG = "epd_attention"


@dataclass
class KVCache:
    """Per-layer block tensors: values ``[kv_heads, num_blocks, block_size, head_dim]``, keys the same or,
    with ``keys_dim_major``, ``[kv_heads, num_blocks, head_dim, block_size]``.

    Head-major, so a gather of whole blocks is directly ``[kv_heads, tokens, head_dim]`` for SDPA. Keys are
    dim-major inside a block for the decode kernel, which scores a block's tokens as one vector per dim
    (SDPA then needs a transposed copy of gathered keys, so only the kernel's engines store them so).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    keys_dim_major: bool = False

    @staticmethod
    def allocate(
        num_layers: int, kv_heads: int, num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, keys_dim_major: bool,
    ) -> KVCache:  # fmt: skip
        """Zeroed tensors for ``num_layers`` layers."""
        layers = range(num_layers)
        value_dims = (kv_heads, num_blocks, block_size, head_dim)
        key_dims = (kv_heads, num_blocks, head_dim, block_size) if keys_dim_major else value_dims
        return KVCache(
            keys=[torch.zeros(key_dims, dtype=dtype, device=device) for _ in layers],
            values=[torch.zeros(value_dims, dtype=dtype, device=device) for _ in layers],
            keys_dim_major=keys_dim_major,
        )

    def key_slots(self, slots: torch.Tensor, block_size: int, head_dim: int) -> torch.Tensor | None:
        """With dim-major keys, the flat indices in one head's keys of token slots ``slots [T]``, dim by dim
        (``[T * D]``); None when keys are stored like values (their slots are ``slots``)."""
        if not self.keys_dim_major:
            return None
        base = slots // block_size * (head_dim * block_size) + slots % block_size
        return (base[:, None] + torch.arange(head_dim, device=slots.device) * block_size).view(-1)


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A multi-token chunk: rows ``[query_start, query_start + query_len)``; its context in blocks.

    ``block_ids`` is None when nothing is cached before the chunk (its own K/V is the context; plain
    causal); otherwise ``mask [query_len, context_len]`` (additive: 0 or -inf) is bottom-right causal.
    """

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Consecutive single-token queries whose block tables are padded to one width of ``blocks`` blocks.

    ``mask`` is built only for SDPA (the kernel reads ``lengths``).
    """

    num_rows: int
    block_ids: torch.Tensor  # [rows * blocks], row-major, padded with block 0
    lengths: torch.Tensor  # [rows] context lengths
    mask: torch.Tensor | None  # [rows, 1, 1, blocks * size] additive: 0 inside the context, -inf past it


@dataclass
class AttentionContext:
    """What one step's attention calls need, built once per step by the model runner (shared by layers).

    Rows are the decode groups' queries in order, then the chunks'. ``key_slots`` is
    ``kv.key_slots(slot_mapping, ...)``. The decode kernel needs ``kv.keys_dim_major``.
    """

    kv: KVCache
    slot_mapping: torch.Tensor
    key_slots: torch.Tensor | None
    decodes: list[DecodeGroup]
    chunks: list[ChunkSpan]
    decode_kernel: DecodeKernel | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]`` to ``(out [1, T, H, D], None)``.

    Without our step context (for example ``generate`` on the same model) it is plain SDPA.
    """
    ctx = kwargs.pop(CONTEXT_KWARG, None)
    if not isinstance(ctx, AttentionContext):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window is not None:
        raise NotImplementedError("paged attention does not support sliding-window layers")
    layer = module.layer_idx
    k_cache, v_cache = ctx.kv.keys[layer], ctx.kv.values[layer]
    key, value = key[0], value[0]  # [Hkv, T, D]
    if ctx.key_slots is None:
        _write_slots(k_cache, key, ctx.slot_mapping)
    else:
        _write_dim_major(k_cache, key, ctx.key_slots)
    _write_slots(v_cache, value, ctx.slot_mapping)
    q = query[0]  # [H, T, D]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    parts = []
    row = 0
    for group in ctx.decodes:
        rows_q = q[:, row : row + group.num_rows]
        if ctx.decode_kernel is not None:
            parts.append(ctx.decode_kernel(rows_q, k_cache, v_cache, group.block_ids, group.lengths, scaling))
        else:
            parts.append(_decode_attention(rows_q, k_cache, v_cache, group, scaling))
        row += group.num_rows
    for chunk in ctx.chunks:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.block_ids is None:  # nothing cached before it: this step's K/V is the context
            keys, values = key[:, rows], value[:, rows]
        else:
            keys = _gather_keys(k_cache, chunk.block_ids, ctx.kv.keys_dim_major)[:, : chunk.context_len]
            values = _gather(v_cache, chunk.block_ids)[:, : chunk.context_len]
        parts.append(_chunk_attention(q[:, rows], keys, values, chunk.mask, scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out.unsqueeze(0), None


def _write_slots(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``rows [Hkv, T, D]`` at flat slot indices ``slots [T]`` of ``cache [Hkv, blocks, size, D]``."""
    heads, _, _, head_dim = cache.shape
    cache.view(heads, -1, head_dim).index_copy_(1, slots, rows.to(cache.dtype))


def _write_dim_major(cache: torch.Tensor, rows: torch.Tensor, key_slots: torch.Tensor) -> None:
    """Store ``rows [Hkv, T, D]`` in ``cache [Hkv, blocks, D, size]`` at ``key_slots [T * D]``."""
    heads = cache.shape[0]
    cache.view(heads, -1).index_copy_(1, key_slots, rows.reshape(heads, -1).to(cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks ``block_ids [n]`` of ``cache [Hkv, blocks, size, D]`` as ``[Hkv, n * size, D]``."""
    return cache.index_select(1, block_ids).flatten(1, 2)


def _gather_keys(cache: torch.Tensor, block_ids: torch.Tensor, dim_major: bool) -> torch.Tensor:
    """Whole blocks ``block_ids [n]`` of a keys tensor as ``[Hkv, n * size, D]``."""
    if not dim_major:
        return _gather(cache, block_ids)
    return cache.index_select(1, block_ids).transpose(2, 3).flatten(1, 2)  # a copy: [Hkv, n, size, D] to rows


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scaling: float | None
) -> torch.Tensor:
    """Single-token queries ``[H, B, D]`` against their padded contexts; returns ``[B, H, D]``.

    The query heads sharing a KV head ride on the query-length axis, so no K/V is repeated. Keys are
    head-major here: they are dim-major only in engines whose decodes go through the kernel.
    """
    batch, heads, head_dim = group.num_rows, q.shape[0], q.shape[2]
    kv_heads = k_cache.shape[0]
    keys = _gather(k_cache, group.block_ids).view(kv_heads, batch, -1, head_dim).transpose(0, 1)
    values = _gather(v_cache, group.block_ids).view(kv_heads, batch, -1, head_dim).transpose(0, 1)
    query = q.transpose(0, 1).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask, scale=scaling)
    return out.reshape(batch, heads, head_dim)


def _chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """A chunk's queries ``[H, q, D]`` over its context ``[Hkv, ctx, D]``, bottom-right causal; ``[q, H, D]``.

    ``mask`` None means plain causal (query and context are the same tokens). Inputs get a batch axis:
    4-D inputs take torch's fused CPU kernel, 3-D ones its slow reference path.
    """
    out = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def install_paged_attention(model: torch.nn.Module) -> None:
    """Register ``paged_attention`` and route the model's text config (only) to it.

    Other sub-configs (a vision tower) keep their implementation. The model stays usable without our
    context: ``paged_attention`` falls back to SDPA then.
    """
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    config = model.config
    text_config = config.get_text_config()
    if text_config is config:
        model.set_attn_implementation(ATTENTION_NAME)
        return
    mapping = {}
    for key in config.sub_configs:
        sub = getattr(config, key, None)
        if sub is not None:
            mapping[key] = ATTENTION_NAME if sub is text_config else sub._attn_implementation
    model.set_attn_implementation(mapping)
