"""The pure-torch `varlen_attn` twin against SDPA over the same context gathered by hand, and its argument
checks against torch's own `varlen_attn` (whose checks run before its CUDA-only kernel)."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import AuxRequest, varlen_attn

from services.models.varlen_attention import flash_supports, torch_varlen_attn, varlen_attn_reference

HEAD_DIM = 16


def paged_pool(rng: random.Random, seqs: list[tuple[int, int]], page: int, kv_heads: int, heads: int):
    """A shuffled page pool holding each sequence's context, its queries, and a by-hand expectation.

    ``seqs`` is ``(query_len, context_len)`` per sequence: the queries are the last tokens of the context.
    """
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pages_each = [-(-ctx // page) for _, ctx in seqs]
    total_pages = sum(pages_each) + 3  # spare pages that nobody owns
    order = list(range(total_pages))
    rng.shuffle(order)
    key = torch.randn(total_pages, page, kv_heads, HEAD_DIM, generator=gen)
    value = torch.randn(total_pages, page, kv_heads, HEAD_DIM, generator=gen)
    width = max(pages_each) + 1
    table = torch.full((len(seqs), width), order[-1], dtype=torch.int32)  # padding points at some page
    used = 0
    for i, n in enumerate(pages_each):
        table[i, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    query = torch.randn(sum(q for q, _ in seqs), heads, HEAD_DIM, generator=gen)
    return query, key, value, table


def by_hand(query, key, value, table, seqs, window=(-1, 0)):
    """Per sequence: gather its keys token by token, explicit bottom-right mask, SDPA with repeated KV heads."""
    page, kv_heads = key.shape[1], key.shape[2]
    group = query.shape[1] // kv_heads
    outs, start = [], 0
    for i, (q_len, ctx) in enumerate(seqs):
        slots = [(int(table[i, j // page]), j % page) for j in range(ctx)]
        k = torch.stack([key[b, s] for b, s in slots]).repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = torch.stack([value[b, s] for b, s in slots]).repeat_interleave(group, dim=1)
        q = query[start : start + q_len]
        mask = torch.zeros(q_len, ctx, dtype=torch.bool)
        for r in range(q_len):
            d = r + ctx - q_len
            lo = d - window[0] if window[0] >= 0 else 0
            hi = d + window[1] if window[1] >= 0 else ctx - 1
            mask[r, max(lo, 0) : min(hi, ctx - 1) + 1] = True
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        outs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def call(query, key, value, table, seqs, window=(-1, 0), **kwargs):
    q_lens = [q for q, _ in seqs]
    ctx = [c for _, c in seqs]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(ctx).cumsum(0).tolist()], dtype=torch.int32)
    return varlen_attn_reference(
        query, key, value, cu_q, cu_k, max(q_lens), max(ctx), window_size=window,
        enable_gqa=query.shape[1] != key.shape[2], seqused_k=torch.tensor(ctx, dtype=torch.int32),
        block_table=table, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("page", [16, 256])
def test_random_pools_match_sdpa(group: int, page: int) -> None:
    """Decodes, first chunks (nothing cached), chunks after cached context, lengths around page edges."""
    rng = random.Random(group * 1000 + page)
    kv_heads = 2
    for _ in range(3):
        seqs = []
        for _ in range(rng.randint(1, 7)):
            ctx = rng.choice([1, page - 1, page, page + 1, 2 * page, 2 * page + 1, rng.randint(1, 3 * page)])
            kind = rng.choice(["decode", "first", "chunk"])
            q_len = 1 if kind == "decode" else ctx if kind == "first" else rng.randint(1, ctx)
            seqs.append((q_len, ctx))
        query, key, value, table = paged_pool(rng, seqs, page, kv_heads, kv_heads * group)
        got = call(query, key, value, table, seqs)
        torch.testing.assert_close(got, by_hand(query, key, value, table, seqs), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (0, 0), (5, 2)])
def test_windows(window: tuple[int, int]) -> None:
    rng = random.Random(7)
    seqs = [(1, 20), (5, 37), (16, 16), (9, 40)]
    query, key, value, table = paged_pool(rng, seqs, 16, 2, 4)
    got = call(query, key, value, table, seqs, window)
    torch.testing.assert_close(got, by_hand(query, key, value, table, seqs, window), atol=2e-5, rtol=1e-5)


def test_unpaged_keys_and_seqused_k() -> None:
    """Without a block table, keys are packed by ``cu_seq_k``; ``seqused_k`` uses only a prefix of each."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, HEAD_DIM, generator=gen)
    k = torch.randn(30, 2, HEAD_DIM, generator=gen)
    v = torch.randn(30, 2, HEAD_DIM, generator=gen)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 30], dtype=torch.int32)
    used = torch.tensor([10, 18], dtype=torch.int32)
    got = varlen_attn_reference(q, k, v, cu_q, cu_k, 3, 18, window_size=(-1, 0), enable_gqa=True, seqused_k=used)
    expected = []
    for (qs, qe), (ks, n) in zip([(0, 2), (2, 5)], [(0, 10), (12, 18)], strict=True):
        keys = k[ks : ks + n].repeat_interleave(2, dim=1).transpose(0, 1)
        vals = v[ks : ks + n].repeat_interleave(2, dim=1).transpose(0, 1)
        rows = qe - qs
        mask = torch.arange(n)[None, :] <= torch.arange(rows)[:, None] + n - rows
        expected.append(
            F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), keys, vals, attn_mask=mask).transpose(0, 1)
        )
    torch.testing.assert_close(got, torch.cat(expected), atol=2e-5, rtol=1e-5)


def test_query_that_sees_nothing_gets_zeros_and_lse() -> None:
    """More queries than keys under a causal window: the first queries see no key (FlashAttention writes 0)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4, 2, HEAD_DIM, generator=gen)
    k = torch.randn(2, 2, HEAD_DIM, generator=gen)
    cu_q = torch.tensor([0, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 2], dtype=torch.int32)
    out, lse = varlen_attn_reference(q, k, k, cu_q, cu_k, 4, 2, window_size=(-1, 0), return_aux=AuxRequest(lse=True))
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isinf(lse[:2]).all() and torch.isfinite(lse[2:]).all()
    scores = torch.einsum("hd,khd->hk", q[3], k) * HEAD_DIM**-0.5
    torch.testing.assert_close(lse[3], torch.logsumexp(scores, dim=-1))


def test_signature_mirrors_torch() -> None:
    ours = inspect.signature(varlen_attn_reference).parameters
    theirs = inspect.signature(varlen_attn).parameters
    assert list(ours) == list(theirs)
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        assert ours[name].default == param.default, name


def test_head_errors_match_torch() -> None:
    """torch's own checks run before the kernel (CPU has none): both refuse with the same message."""
    q = torch.randn(3, 6, HEAD_DIM)
    k = torch.randn(3, 4, HEAD_DIM)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for enable_gqa in (False, True):
        with pytest.raises(ValueError) as theirs:
            varlen_attn(q, k, k, cu, cu, 3, 3, enable_gqa=enable_gqa)
        with pytest.raises(ValueError) as ours:
            varlen_attn_reference(q, k, k, cu, cu, 3, 3, enable_gqa=enable_gqa)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_table": None}, "key and value must both be"),
        ({"seqused_k": None}, "block_table requires seqused_k"),
        ({"cu_seq_q": torch.tensor([0, 2, 3], dtype=torch.int64)}, "cu_seq_q must be int32"),
        ({"cu_seq_k": torch.tensor([0, 3], dtype=torch.int32)}, "cu_seq_k must be int32 of shape (3,)"),
        ({"block_table": torch.zeros(2, 2, dtype=torch.int64)}, "block_table must be int32"),
        ({"seqused_k": torch.tensor([1, 2, 3], dtype=torch.int32)}, "seqused_k must be int32 of shape (2,)"),
        ({"max_k": 100}, "exceeds the block table"),
        ({"window_size": (1, 2, 3)}, "window_size must have length 2"),
    ],
)
def test_argument_checks(change: dict, message: str) -> None:
    args = {
        "query": torch.randn(3, 4, HEAD_DIM), "key": torch.randn(4, 16, 2, HEAD_DIM),
        "value": torch.randn(4, 16, 2, HEAD_DIM), "cu_seq_q": torch.tensor([0, 2, 3], dtype=torch.int32),
        "cu_seq_k": torch.tensor([0, 5, 9], dtype=torch.int32), "max_q": 2, "max_k": 5,
        "seqused_k": torch.tensor([5, 4], dtype=torch.int32), "block_table": torch.zeros(2, 2, dtype=torch.int32),
    }  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        varlen_attn_reference(**args, enable_gqa=True)


def test_kernel_needs_cuda_half() -> None:
    """Where the real kernel is chosen: never on this CPU, never for float32."""
    assert torch_varlen_attn() is varlen_attn  # torch 2.13's takes a block table
    assert not flash_supports(torch.device("cpu"), torch.bfloat16)
    assert not flash_supports(torch.device("cuda"), torch.float32)
