"""The `cpu-kernel` backend: `sdpa`'s chunks, with decodes through the compiled CPU kernel over blocks in place.

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


class CpuKernelBackend(SdpaBackend):
    name = "cpu-kernel"
    kv_layout = DIM_MAJOR_KEYS
    group_cost = ONE_GROUP

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype, kernel: DecodeKernel) -> None:
        super().__init__(block_size, device, dtype)
        self.decode_kernel = kernel
