"""The `triton` backend: our Triton kernel (triton_kernel.py) over the paged KV pool, one call per layer per step.

`flash`'s metadata, KV layout and call (varlen.py) with the kernel in place of torch's `varlen_attn`, so it runs
where torch's FlashAttention takes no block table (torch before 2.12) and decode steps can still be captured as
CUDA graphs. Any block size that is a multiple of 16; float16/bfloat16 on CUDA (float32 too, for checks). On the
CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1``: tests), in float32 or float16 (the
interpreter's bfloat16 dot is wrong). Triton is optional (``pip install 'epd[gpu]'``); nothing imports it until
this backend is built.
"""

from __future__ import annotations

import functools
import logging

import torch

from services.worker.engine.attention.varlen import VarlenBackend

log = logging.getLogger(__name__)

BLOCK_MULTIPLE = 16
"""Block sizes the kernel takes: multiples of 16 (its smallest key tile)."""


@functools.cache
def triton_imports() -> bool:
    """Whether Triton imports in this process (the GPU image's optional dependency)."""
    try:
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install that fails while loading
        log.debug("Triton does not import: %r", exc)
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on tensors in host memory."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


class TritonBackend(VarlenBackend):
    name = "triton"

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        if not triton_imports():
            raise ValueError("the triton attention backend needs Triton (pip install 'epd[gpu]')")
        if block_size % BLOCK_MULTIPLE:
            raise ValueError(
                f"the triton attention backend needs a block size that is a multiple of {BLOCK_MULTIPLE}, "
                f"got {block_size}"
            )
        if device.type == "cuda":
            allowed = (torch.float16, torch.bfloat16, torch.float32)
        elif device.type == "cpu" and interpreted():
            allowed = (torch.float32, torch.float16)
        else:
            raise ValueError(
                f"the triton attention backend runs on CUDA, or on the CPU under TRITON_INTERPRET=1; got {device}"
            )
        if dtype not in allowed:
            where = "on CUDA" if device.type == "cuda" else "under Triton's interpreter"
            raise ValueError(f"the triton attention backend takes {', '.join(map(str, allowed))} {where}, got {dtype}")
        from services.worker.engine.attention.triton_kernel import triton_varlen_attn

        super().__init__(block_size, triton_varlen_attn)
