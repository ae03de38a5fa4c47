"""The `flash` backend: torch's FlashAttention (`varlen_attn`) over the paged KV pool, one call per layer per step.

CUDA only, float16/bfloat16, a torch whose `varlen_attn` takes a `block_table`, and blocks a multiple of
256 tokens (FlashAttention-2's paged-KV rule in aten's flash_api.cpp). Metadata and call: varlen.py,
shared with `flash-reference`.
"""

from __future__ import annotations

import torch

from services.models.varlen_attention import flash_supports, torch_varlen_attn
from services.worker.engine.attention.varlen import VarlenBackend

PAGE_MULTIPLE = 256
"""FlashAttention's paged KV needs ``page_block_size % 256 == 0``."""


class FlashBackend(VarlenBackend):
    name = "flash"

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        if not flash_supports(device, dtype):
            raise ValueError(
                f"the flash attention backend needs CUDA, float16 or bfloat16 and a torch whose varlen_attn takes a "
                f"block_table; got device {device}, dtype {dtype}, torch {torch.__version__} (use flash-reference)"
            )
        if block_size % PAGE_MULTIPLE:
            raise ValueError(
                f"the flash attention backend needs a block size that is a multiple of {PAGE_MULTIPLE}, "
                f"got {block_size}"
            )
        super().__init__(block_size, torch_varlen_attn())
