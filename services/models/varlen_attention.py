"""Variable-length attention: torch's FlashAttention `varlen_attn` where it runs, and a pure-torch twin.

`varlen_attn_reference` has the signature and semantics of `torch.nn.attention.varlen.varlen_attn` (torch
2.13), including a paged KV pool with `block_table` and `seqused_k`, sliding windows and GQA, so code that
calls the CUDA kernel on a GPU runs unchanged, and is tested, on a CPU. Where the two differ on purpose:
the reference takes any floating dtype (the kernel: float16/bfloat16 on CUDA only), any page size (the
kernel: a multiple of 256 with a block table) and ignores `num_splits` (it is batch-invariant anyway).

Semantics (FlashAttention's): sequence `i` has `q_i = cu_seq_q[i+1] - cu_seq_q[i]` queries and
`k_i = seqused_k[i]` keys when `seqused_k` is given, else `cu_seq_k[i+1] - cu_seq_k[i]`. With a block table
its key `j` lives at `key[block_table[i, j // page], j % page]`, else at `key[cu_seq_k[i] + j]`. Windows
are bottom-right aligned: query `r` sits at key position `d = r + k_i - q_i` and sees keys
`d - left <= j <= d + right` (a negative bound is unbounded), so `(-1, 0)` is causal with a chunk's
queries being the last tokens of its context. A query that sees no key gets zeros. `max_q` and `max_k`
must bound the lengths, as for the kernel (they are host integers: nothing here reads device values).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

VarlenFn = Callable[..., Any]


@functools.cache
def torch_varlen_attn(paged: bool = True) -> VarlenFn | None:
    """torch's `varlen_attn` when this torch has one (that takes a paged KV, `block_table`, when ``paged``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if paged and "block_table" not in inspect.signature(varlen_attn).parameters:
        return None
    return varlen_attn


def flash_supports(device: torch.device, dtype: torch.dtype, paged: bool = True) -> bool:
    """Whether torch's FlashAttention kernel can run here: CUDA, float16/bfloat16, and a `varlen_attn` (paged
    when ``paged``: the worker's KV; the vision tower's packed batch needs no pages)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return torch_varlen_attn(paged) is not None


def varlen_attn_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attn` in plain torch: ``query [Tq, Hq, D]`` to ``[Tq, Hq, D]`` (and ``lse [Tq, Hq]`` when
    ``return_aux.lse``). Raises ValueError for the argument errors ``varlen_attn`` and its kernel refuse."""
    num_seqs = _check_arguments(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa, seqused_k, block_table
    )
    device, total_q = query.device, query.shape[0]
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[-2]
    if max_q == 0 or max_k == 0:  # nothing to attend to: zeros, as the kernel writes
        empty = query.new_zeros(query.shape)
        lse = query.new_full((total_q, heads), float("inf"), dtype=torch.float32)
        return (empty, lse) if return_aux is not None and getattr(return_aux, "lse", False) else empty
    scale = head_dim**-0.5 if scale is None else scale
    q_start = cu_seq_q[:-1].long()
    q_len = cu_seq_q[1:].long() - q_start
    k_len = seqused_k.long() if seqused_k is not None else cu_seq_k[1:].long() - cu_seq_k[:-1].long()
    rows = torch.arange(max_q, device=device)
    cols = torch.arange(max_k, device=device)
    q_valid = rows[None, :] < q_len[:, None]  # [N, max_q]
    q_index = torch.where(q_valid, q_start[:, None] + rows[None, :], total_q)  # padding rows -> a spare row
    padded_query = F.pad(query, (0, 0, 0, 0, 0, 1))[q_index]  # [N, max_q, Hq, D]
    keys, values = _gather_context(key, value, cu_seq_k, block_table, num_seqs, max_k)
    diagonal = rows[None, :, None] + (k_len - q_len)[:, None, None]  # each query's own key position
    allowed = cols[None, None, :] < k_len[:, None, None]
    left, right = window_size
    if left >= 0:
        allowed = allowed & (cols[None, None, :] >= diagonal - left)
    if right >= 0:
        allowed = allowed & (cols[None, None, :] <= diagonal + right)
    sees_any = allowed.any(dim=-1, keepdim=True)  # [N, max_q, 1]
    # a query that sees nothing attends to key 0 (finite softmax) and is zeroed below, as the kernel writes
    mask = allowed | (~sees_any & (cols[None, None, :] == 0))
    out = F.scaled_dot_product_attention(
        padded_query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=heads != kv_heads,
    ).transpose(1, 2)  # fmt: skip
    out = torch.where(sees_any[..., None], out, 0.0).to(query.dtype)
    flat = query.new_zeros((total_q + 1, heads, head_dim))
    flat.index_copy_(0, q_index.view(-1), out.reshape(-1, heads, head_dim))
    result = flat[:total_q]
    if return_aux is not None and getattr(return_aux, "lse", False):
        lse = _log_sum_exp(padded_query, keys, allowed, sees_any, scale, heads // kv_heads)
        lse_flat = query.new_zeros((total_q + 1, heads), dtype=torch.float32)
        lse_flat.index_copy_(0, q_index.view(-1), lse.reshape(-1, heads))
        return result, lse_flat[:total_q]
    return result


def _gather_context(
    key: torch.Tensor, value: torch.Tensor, cu_seq_k: torch.Tensor | None, block_table: torch.Tensor | None,
    num_seqs: int, max_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each sequence's first ``max_k`` keys and values, padded: ``[N, max_k, Hkv, D]`` each."""
    if block_table is not None:
        page = key.shape[1]
        pages = -(-max_k // page)
        table = block_table[:, :pages].long()
        shape = (num_seqs, pages * page, key.shape[2], key.shape[3])
        return key[table].reshape(shape)[:, :max_k], value[table].reshape(shape)[:, :max_k]
    cols = torch.arange(max_k, device=key.device)
    index = (cu_seq_k[:-1].long()[:, None] + cols[None, :]).clamp(max=max(key.shape[0] - 1, 0))
    return key[index], value[index]


def _log_sum_exp(
    query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sees_any: torch.Tensor, scale: float, group: int
) -> torch.Tensor:
    """Log-sum-exp of the scaled scores each query sees: ``[N, max_q, Hq]`` (+inf where it sees none)."""
    keys = keys.repeat_interleave(group, dim=2) if group > 1 else keys
    scores = torch.einsum("nqhd,nkhd->nqhk", query.float(), keys.float()) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.where(sees_any, lse, float("inf"))


def _check_arguments(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, window_size: tuple[int, int], enable_gqa: bool,
    seqused_k: torch.Tensor | None, block_table: torch.Tensor | None,
) -> int:  # fmt: skip
    """The checks ``varlen_attn`` and FlashAttention's ``mha_varlen_fwd`` make (shapes, dtypes, heads); returns
    the number of sequences. Reads no tensor values."""
    if query.dim() != 3:
        raise ValueError(f"query must be [T_q, H_q, D], got shape {tuple(query.shape)}")
    paged = block_table is not None
    if key.dim() != (4 if paged else 3) or value.shape != key.shape:
        expected = "[total_pages, page_size, H_kv, D] with a block_table" if paged else "[T_k, H_kv, D]"
        raise ValueError(f"key and value must both be {expected}, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    heads, kv_heads, head_dim = query.shape[1], key.shape[-2], query.shape[2]
    if key.shape[-1] != head_dim:
        raise ValueError(f"query head dim {head_dim} differs from key head dim {key.shape[-1]}")
    if head_dim % 8 != 0 or head_dim > 256:
        raise ValueError(f"head dim must be a multiple of 8 and at most 256 (FlashAttention), got {head_dim}")
    if not enable_gqa and heads != kv_heads:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={heads} and Hkv={kv_heads}. "
            "Try setting enable_gqa=True for GQA."
        )
    if enable_gqa and heads % kv_heads != 0:
        raise ValueError(
            f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={heads} and Hkv={kv_heads}."
        )
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    if cu_seq_q.dim() != 1 or cu_seq_q.dtype != torch.int32 or cu_seq_q.shape[0] < 2:
        raise ValueError(
            f"cu_seq_q must be int32 of shape (N+1,) with N >= 1, got {cu_seq_q.dtype} {tuple(cu_seq_q.shape)}"
        )
    num_seqs = cu_seq_q.shape[0] - 1
    if cu_seq_k is None or cu_seq_k.dtype != torch.int32 or tuple(cu_seq_k.shape) != (num_seqs + 1,):
        got = None if cu_seq_k is None else f"{cu_seq_k.dtype} {tuple(cu_seq_k.shape)}"
        raise ValueError(f"cu_seq_k must be int32 of shape ({num_seqs + 1},), got {got}")
    if seqused_k is not None and (seqused_k.dtype != torch.int32 or tuple(seqused_k.shape) != (num_seqs,)):
        raise ValueError(
            f"seqused_k must be int32 of shape ({num_seqs},), got {seqused_k.dtype} {tuple(seqused_k.shape)}"
        )
    if paged:
        if seqused_k is None:
            raise ValueError("block_table requires seqused_k")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != num_seqs:
            raise ValueError(
                f"block_table must be int32 of shape ({num_seqs}, max_pages), got {block_table.dtype} "
                f"{tuple(block_table.shape)}"
            )
        if block_table.stride(-1) != 1:
            raise ValueError("block_table must have contiguous last dimension")
        if max_k > block_table.shape[1] * key.shape[1]:
            raise ValueError(f"max_k={max_k} exceeds the block table's {block_table.shape[1]} pages of {key.shape[1]}")
    if max_q < 0 or max_k < 0:
        raise ValueError(f"max_q and max_k must be >= 0, got {max_q} and {max_k}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous last dimension")
    return num_seqs
