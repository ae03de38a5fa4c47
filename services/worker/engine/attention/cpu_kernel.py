"""The `cpu-kernel` backend: `sdpa` with decodes, bfloat16 chunks with nothing cached before them, and short chunks
after a cached context, through the compiled CPU kernel over blocks in place (each chunk row a decode of its own).

Whether bfloat16 chunks with nothing cached before them go through the kernel is measured on the box
(`kernel_wins_fresh_chunks`): the kernel does only the causal half of the products, in float32 vector code;
torch's flash kernel does the whole square up to 512 keys, but on a CPU with AMX its bfloat16 products are tiles.

Keys are stored dim-major inside a block (`kv_cache.DIM_MAJOR_KEYS`), as the kernel scores a block's 16
tokens as one vector per dim. The kernel reads only each row's own blocks, so all decodes form one group.
Applies to float32 and bfloat16 on the CPU with 16-token blocks and head dims a multiple of 16, with a C compiler.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from services.worker.engine.attention.kv_cache import DIM_MAJOR_KEYS
from services.worker.engine.attention.sdpa import SdpaBackend, chunk_attention
from services.worker.engine.decode_kernel import BLOCK_SIZE, DecodeKernel

ONE_GROUP = 1 << 40
"""A group cost no padding outweighs: all decodes in one group."""
KERNEL_CHUNK_WORK = 16 * 1024
"""Chunks after a cached context with query x context length up to this go through the kernel, a row each (a
prefix-cache hit's last block): below it gathering the context and calling SDPA cost more than the kernel's rows
(one thread, 64-dim heads: 8 rows over 300 tokens 0.08 against 0.16 ms, 16 over 2,000 1.25 against 0.92)."""


PROBE_TOKENS = 256
"""Length of the fresh chunk both ways are timed on (a prompt's first chunk is typically a few hundred tokens)."""
PROBE_HEADS, PROBE_KV_HEADS = 4, 2


class CpuKernelBackend(SdpaBackend):
    """``fresh_chunks``: bfloat16 chunks with nothing cached before them go through the kernel too (where
    `kernel_wins_fresh_chunks`); never float32 ones: the whole prefill step gained ~4 % there, which does not pay for
    moving the numerics the float32 folders are held exact on."""

    name = "cpu-kernel"
    kv_layout = DIM_MAJOR_KEYS
    group_cost = ONE_GROUP
    kernel_chunk_work = KERNEL_CHUNK_WORK

    def __init__(
        self, block_size: int, device: torch.device, dtype: torch.dtype, kernel: DecodeKernel, fresh_chunks: bool
    ) -> None:
        super().__init__(block_size, device, dtype)
        self.decode_kernel = kernel
        self.kernel_fresh_chunks = fresh_chunks and dtype == torch.bfloat16


def fresh_chunk_probe(
    kernel: DecodeKernel, head_dim: int
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """The kernel's call and SDPA's on one bfloat16 chunk of ``PROBE_TOKENS`` tokens with nothing cached before it,
    each returning ``[tokens, heads, head_dim]``: the same attention, laid out as each takes it (the kernel: keys
    dim-major in 16-token blocks, row r over the first r + 1 tokens; SDPA: one causal call over the rows)."""
    generator = torch.Generator().manual_seed(0)
    tokens, blocks = PROBE_TOKENS, PROBE_TOKENS // BLOCK_SIZE

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    q, k, v = (
        rand(PROBE_HEADS, tokens, head_dim),
        rand(PROBE_KV_HEADS, tokens, head_dim),
        rand(PROBE_KV_HEADS, tokens, head_dim),
    )
    keys = k.view(PROBE_KV_HEADS, blocks, BLOCK_SIZE, head_dim).transpose(2, 3).contiguous()
    values = v.view(PROBE_KV_HEADS, blocks, BLOCK_SIZE, head_dim).contiguous()
    tables = torch.arange(blocks, dtype=torch.int64).repeat(tokens)
    lengths = torch.arange(1, tokens + 1, dtype=torch.int64)
    scale = head_dim**-0.5
    return (
        lambda: kernel(q, keys, values, tables, lengths, scale),
        lambda: chunk_attention(q, k, v, None, scale),
    )


def kernel_wins_fresh_chunks(kernel: DecodeKernel, head_dim: int, repeats: int = 5) -> tuple[bool, float, float]:
    """Whether the kernel attends a fresh bfloat16 chunk faster than SDPA here, and both best times (seconds) over
    ``repeats`` calls each after one untimed; ~10 ms at start-up. On a 2-core AMD EPYC (Zen 5) the kernel took
    0.39 ms against SDPA's 1.09 for a 295-token chunk; on a 2-core Intel Xeon with AMX a 16 x 295-token prefill spent
    137 ms in the kernel, and the whole wave took 258 ms against 181 with SDPA (docs/engine.md)."""
    timed = []
    for call in fresh_chunk_probe(kernel, head_dim):
        call()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        timed.append(best)
    return timed[0] < timed[1], timed[0], timed[1]
