"""The `cpu-kernel` backend: `sdpa` with decodes, bfloat16 chunks with nothing cached before them, and short chunks
after a cached context, through the compiled CPU kernel over blocks in place (each chunk row a decode of its own).

Keys are stored dim-major inside a block (`kv_cache.DIM_MAJOR_KEYS`), as the kernel scores a block's 16
tokens as one vector per dim. The kernel reads only each row's own blocks, so all decodes form one group.
Applies to float32 and bfloat16 on the CPU with 16-token blocks and head dims a multiple of 16, with a C compiler.
"""

from __future__ import annotations

import torch

from services.worker.engine.attention.kv_cache import DIM_MAJOR_KEYS
from services.worker.engine.attention.sdpa import SdpaBackend
from services.worker.engine.decode_kernel import DecodeKernel

ONE_GROUP = 1 << 40
"""A group cost no padding outweighs: all decodes in one group."""
KERNEL_CHUNK_WORK = 16 * 1024
"""Chunks after a cached context with query x context length up to this go through the kernel, a row each (a
prefix-cache hit's last block): below it gathering the context and calling SDPA cost more than the kernel's rows
(one thread, 64-dim heads: 8 rows over 300 tokens 0.08 against 0.16 ms, 16 over 2,000 1.25 against 0.92)."""


class CpuKernelBackend(SdpaBackend):
    name = "cpu-kernel"
    kv_layout = DIM_MAJOR_KEYS
    group_cost = ONE_GROUP
    kernel_chunk_work = KERNEL_CHUNK_WORK

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype, kernel: DecodeKernel) -> None:
        super().__init__(block_size, device, dtype)
        self.decode_kernel = kernel
        # a bfloat16 prefill gains most (torch's flash kernel is no faster in bfloat16 than in float32); a float32
        # one ~4 %, which does not pay for moving the numerics the float32 folders are held exact on
        self.kernel_fresh_chunks = dtype == torch.bfloat16
