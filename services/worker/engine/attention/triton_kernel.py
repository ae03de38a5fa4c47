"""The `triton` backend's kernel: one Triton program family for decodes and prefill chunks over the paged KV pool.

`triton_varlen_attn` takes `varlen_attn`'s paged arguments (``block_table`` and ``seqused_k`` required) and has
its semantics (services/models/varlen_attention.py): GQA, bottom-right aligned windows (``(-1, 0)`` causal),
zeros for a query that sees no key, any page size. Importing this module imports Triton; the caller checks it
imports (`triton_imports`) first.

Grid ``(T // BLOCK_Q + N, Hkv)`` for ``T`` query rows and ``N`` sequences, host integers only (fixed in a decode
graph). A program takes ``BLOCK_Q`` consecutive queries of one sequence together with the ``GROUP`` query heads
that share its KV head (``BLOCK_M`` rows, a power of two, padding rows masked), so each K/V tile is read once
per group. Sequence ``i``'s query blocks are programs ``cu_seq_q[i] // BLOCK_Q + i`` on, so a program finds its
sequence by a binary search over ``cu_seq_q`` on the device; programs past their sequence's queries return at
once. Keys are visited in tiles of ``BLOCK_N`` positions from the window's first to the last any of the block's
queries sees (from ``seqused_k``, read on the device: the launch never depends on context lengths, and
``max_k`` is not read); key ``j``'s slot is ``block_table[i, j // PAGE] * PAGE + j % PAGE``. Softmax is online in
float32; probabilities are cast to the value dtype for the second product, as FlashAttention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

UNBOUNDED = 1 << 30
"""A window side of -1 (unbounded) as a bound no position reaches (positions stay far below 2**30)."""


@triton.jit
def _paged_attention(
    out, query, key_pool, value_pool, cu_seq_q, seqused_k, block_table,
    scale, num_seqs, table_stride, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    kv_stride_block, kv_stride_slot, kv_stride_head, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_QUERY: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    if ONE_QUERY:  # no sequence has more than one query (a decode step): program i is sequence i
        seq = program.to(tl.int64)
        q_start = tl.load(cu_seq_q + seq).to(tl.int64)
        q_len = tl.load(cu_seq_q + seq + 1).to(tl.int64) - q_start
        first_q = 0
    else:
        # the last sequence whose first query block, cu_seq_q[i] // BLOCK_Q + i, is at most program
        lo_seq: tl.int32 = 0
        hi_seq = num_seqs
        while lo_seq < hi_seq:
            mid = (lo_seq + hi_seq) // 2
            if tl.load(cu_seq_q + mid) // BLOCK_Q + mid <= program:
                lo_seq = mid + 1
            else:
                hi_seq = mid
        seq = (lo_seq - 1).to(tl.int64)
        q_start = tl.load(cu_seq_q + seq).to(tl.int64)
        q_len = tl.load(cu_seq_q + seq + 1).to(tl.int64) - q_start
        first_q = (program - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if first_q >= q_len:
            return
    # index arithmetic in int64: no overflow on large pools
    k_len = tl.load(seqused_k + seq).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    q_index = first_q + rows // GROUP  # each row's query, within its sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_index < q_len)
    dims = tl.arange(0, HEAD_PAD)
    q_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_start + q_index
    q = tl.load(query + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :], mask=q_mask)
    diagonal = q_index + (k_len - q_len)  # each row's own position in its context (bottom-right alignment)
    row_lo = (diagonal - window_left)[:, None]
    row_hi = (diagonal + window_right)[:, None]
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    hi = tl.minimum(k_len, last_q + (k_len - q_len) + window_right + 1)  # past the last key any row sees
    lo = tl.maximum(first_q + (k_len - q_len) - window_left, 0)  # the first key any row sees
    # a finite floor: a row that has seen no key yet keeps probabilities 0 and rescales by 1 (no inf - inf)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_table + seq * table_stride
    k_base = key_pool + kv_head * kv_stride_head
    v_base = value_pool + kv_head * kv_stride_head
    for tile in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        cols = tile + tl.arange(0, BLOCK_N)
        col_ok = cols < hi  # and >= 0: keys before lo are in the sequence's pages, masked below
        page = tl.load(table + cols // PAGE, mask=col_ok, other=0).to(tl.int64)
        slots = (page * kv_stride_block + (cols % PAGE) * kv_stride_slot)[:, None] + dims[None, :]
        kv_mask = col_ok[:, None] if HEAD_PAD == HEAD_DIM else col_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_base + slots, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = col_ok[None, :] & (cols[None, :] >= row_lo) & (cols[None, :] <= row_hi)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        probs = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(probs, 1)
        v = tl.load(v_base + slots, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    result = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that saw no key: zeros
    tl.store(out + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
             result.to(out.dtype.element_ty), mask=q_mask)  # fmt: skip


@dataclass(frozen=True)
class Tiles:
    """A launch's tile sizes: ``block_m`` rows (``block_q`` queries x the GQA group, padded), ``block_n`` keys."""

    block_q: int
    block_m: int
    block_n: int
    num_warps: int


def tiles_for(max_q: int, group: int, device: torch.device) -> Tiles:
    """Tiles for a step whose longest query run is ``max_q`` with ``group`` query heads per KV head.

    Decode steps (``max_q`` 1) take one query a program: ``block_m`` is the group padded to 16 rows (the least a
    dot takes). Chunks take 64 rows or more. Keys: 32 a tile on CUDA; under the interpreter (the CPU) every
    operation costs Python overhead whatever its size, so tiles of 256 keys.
    """
    block_m = max(16, triton.next_power_of_2(group))
    cuda = device.type == "cuda"
    block_n, warps = (32, 4) if cuda else (1024, 1)
    if max_q == 1:
        return Tiles(1, block_m, block_n, warps)
    block_m = max(64, block_m)
    return Tiles(block_m // group, block_m, block_n, warps)


def triton_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """`varlen_attn` over a page pool: ``query [T, Hq, D]``, ``key``/``value [pages, PAGE, Hkv, D]``; ``[T, Hq, D]``.

    Reads no device value on the host (capturable in a CUDA graph): the launch shape comes from the tensors'
    shapes and ``max_q``; ``cu_seq_k`` and ``max_k`` are accepted for the signature and not read. ``tiles``
    overrides `tiles_for` (tests). Raises ValueError for arguments the kernel does not take.
    """
    if block_table is None or seqused_k is None:
        raise ValueError("the triton kernel reads a paged KV pool: block_table and seqused_k are required")
    total_q, heads, head_dim = query.shape
    _, page, kv_heads, _ = key.shape
    if heads % kv_heads or (heads != kv_heads and not enable_gqa):
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads (enable_gqa={enable_gqa})")
    if key.stride() != value.stride() or key.stride(-1) != 1 or query.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("query, key, value and block_table need a contiguous last dimension; key and value one layout")
    if cu_seq_q.dtype != torch.int32 or seqused_k.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ValueError("cu_seq_q, seqused_k and block_table must be int32")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = cu_seq_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0:
        return out
    group = heads // kv_heads
    chosen = tiles or tiles_for(max_q, group, query.device)
    left, right = (UNBOUNDED if w < 0 else w for w in window_size)
    one_query = max_q == 1 and chosen.block_q == 1
    grid = (num_seqs if one_query else total_q // chosen.block_q + num_seqs, kv_heads)
    _paged_attention[grid](
        out, query, key, value, cu_seq_q, seqused_k, block_table,
        head_dim**-0.5 if scale is None else scale, num_seqs, block_table.stride(0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), key.stride(2), left, right,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=group, PAGE=page,
        BLOCK_Q=chosen.block_q, BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n, ONE_QUERY=one_query,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=chosen.num_warps,
    )  # fmt: skip
    return out
