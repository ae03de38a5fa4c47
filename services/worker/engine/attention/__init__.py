"""Attention backends: named, swappable pieces of the model runner, and how one is chosen.

- `cpu-kernel` (cpu_kernel.py): CPU, float32, 16-token blocks; decodes through the compiled C kernel over
  blocks in place (keys dim-major inside a block), chunks as `sdpa`.
- `sdpa` (sdpa.py): anywhere; blocks gathered, one SDPA call per decode group and per chunk.
- `flash` (flash.py): CUDA, fp16/bf16, blocks a multiple of 256; torch's `varlen_attn` over the page pool,
  one call per layer per step.
- `flash-reference` (flash_reference.py): anywhere; `flash`'s metadata and call (varlen.py) with the
  pure-torch twin of `varlen_attn`.

``auto`` picks `flash` on CUDA where it runs, `flash-reference` on CUDA otherwise, `cpu-kernel` on the CPU
where it applies (and builds), else `sdpa`.
"""

from __future__ import annotations

import logging

import torch

from services.models.varlen_attention import flash_supports
from services.worker.engine.attention.backend import AttentionBackend
from services.worker.engine.attention.cpu_kernel import CpuKernelBackend
from services.worker.engine.attention.flash import PAGE_MULTIPLE, FlashBackend
from services.worker.engine.attention.flash_reference import FlashReferenceBackend
from services.worker.engine.attention.sdpa import SdpaBackend
from services.worker.engine.decode_kernel import BLOCK_SIZE as KERNEL_BLOCK_SIZE
from services.worker.engine.decode_kernel import DecodeKernel, load_decode_kernel

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""Tokens per block for every backend but `flash` (which needs a multiple of ``PAGE_MULTIPLE``)."""


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    """The backend name ``requested`` stands for (``auto`` resolved); ``block_size`` 0 means not set."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        if flash_supports(device, dtype) and block_size % PAGE_MULTIPLE == 0:
            return "flash"
        log.warning(
            "FlashAttention's paged varlen_attn cannot run here (dtype %s, block size %s, torch %s): "
            "attention uses sdpa",
            dtype,
            block_size or "auto",
            torch.__version__,
        )
        return "sdpa"
    if DecodeKernel.applies(block_size or KERNEL_BLOCK_SIZE, head_dim, dtype, device) and load_decode_kernel():
        return "cpu-kernel"
    return "sdpa"


def default_block_size(name: str) -> int:
    """The block size a backend gets when none is configured."""
    return PAGE_MULTIPLE if name == "flash" else DEFAULT_BLOCK_SIZE


def make_backend(
    name: str, block_size: int, device: torch.device, dtype: torch.dtype, head_dim: int
) -> AttentionBackend:
    """The backend ``name`` (resolved, not ``auto``) for ``block_size``-token blocks; ValueError (naming what is
    wrong) where it cannot run."""
    if name == "flash":
        return FlashBackend(block_size, device, dtype)
    if name == "flash-reference":
        return FlashReferenceBackend(block_size)
    if name == "sdpa":
        return SdpaBackend(block_size, device, dtype)
    if name == "cpu-kernel":
        if not DecodeKernel.applies(block_size, head_dim, dtype, device):
            raise ValueError(
                f"the cpu-kernel attention backend needs float32 on the CPU, {KERNEL_BLOCK_SIZE}-token "
                f"blocks and a head dim that is a multiple of 16; got {dtype} on {device}, block size "
                f"{block_size}, head dim {head_dim}"
            )
        kernel = load_decode_kernel()
        if kernel is None:
            raise ValueError("the cpu-kernel attention backend could not be built (no working C compiler): use sdpa")
        return CpuKernelBackend(block_size, device, dtype, kernel)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "choose_backend", "default_block_size", "make_backend"]
