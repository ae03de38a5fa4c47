"""Attention backends: named, swappable pieces of the model runner, and how one is chosen.

- `cpu-kernel` (cpu_kernel.py): CPU, float32 or bfloat16, 16-token blocks; decodes, bfloat16 first chunks and short
  chunks after a cached context through the compiled C kernel over blocks in place (keys dim-major inside a block),
  other chunks as `sdpa`.
- `sdpa` (sdpa.py): anywhere; blocks gathered, one SDPA call per decode group and per chunk.
- `flash` (flash.py): CUDA, fp16/bf16, blocks a multiple of 256; torch's `varlen_attn` over the page pool,
  one call per layer per step.
- `flash-reference` (flash_reference.py): anywhere; `flash`'s metadata and call (varlen.py) with the
  pure-torch twin of `varlen_attn`.
- `triton` (triton_backend.py): CUDA (or the CPU under Triton's interpreter), blocks a multiple of 16; `flash`'s
  metadata and call with our Triton kernel (triton_kernel.py).

``auto`` on CUDA picks `flash` where torch's `varlen_attn` takes a block table (float16/bfloat16, blocks a
multiple of 256), else `triton` where Triton imports (float16/bfloat16, blocks a multiple of 16), else `sdpa`;
on the CPU `cpu-kernel` where it applies (and builds), else `sdpa`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.models.varlen_attention import torch_varlen_attn
from services.worker.engine.attention.backend import AttentionBackend
from services.worker.engine.attention.cpu_kernel import PROBE_TOKENS, CpuKernelBackend, kernel_wins_fresh_chunks
from services.worker.engine.attention.flash import PAGE_MULTIPLE, FlashBackend
from services.worker.engine.attention.flash_reference import FlashReferenceBackend
from services.worker.engine.attention.sdpa import SdpaBackend
from services.worker.engine.attention.triton_backend import BLOCK_MULTIPLE, TritonBackend, triton_imports
from services.worker.engine.decode_kernel import BLOCK_SIZE as KERNEL_BLOCK_SIZE
from services.worker.engine.decode_kernel import DecodeKernel, load_decode_kernel

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""Tokens per block for every backend but `flash` (which needs a multiple of ``PAGE_MULTIPLE``)."""


VARLEN_BACKENDS = ("flash", "flash-reference", "triton")
"""The backends of varlen.py's metadata and call: decode-only steps can run through the decode graphs."""
GRAPHED_BY_DEFAULT = ("flash", "triton")
"""Varlen backends whose kernels read only each row's used blocks (`flash-reference` pads every row to the
graphs' ``max_k``), so ``cuda_graphs=auto`` captures with them."""
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Offers:
    """What the installed torch and Triton offer the CUDA choice: torch's paged `varlen_attn`, Triton."""

    paged_varlen_attn: bool
    triton: bool

    @classmethod
    def here(cls) -> Offers:
        return cls(paged_varlen_attn=torch_varlen_attn() is not None, triton=triton_imports())


def choose_backend(
    requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
    offers: Offers | None = None,
) -> str:  # fmt: skip
    """The backend name ``requested`` stands for (``auto`` resolved); ``block_size`` 0 means not set.

    ``offers`` (default: what this process has) decides the CUDA choice; the choice is logged when it is not
    the first one (`flash`).
    """
    if requested != "auto":
        return requested
    if device.type == "cuda":
        offers = offers or Offers.here()
        half = dtype in HALF_DTYPES
        if half and offers.paged_varlen_attn and block_size % PAGE_MULTIPLE == 0:
            return "flash"
        if half and offers.triton and block_size % BLOCK_MULTIPLE == 0:
            log.info(
                "FlashAttention's paged varlen_attn cannot run here (torch %s, block size %s): attention uses triton",
                torch.__version__,
                block_size or "auto",
            )
            return "triton"
        log.warning(
            "neither FlashAttention's paged varlen_attn nor Triton can run here (dtype %s, block size %s, torch %s, "
            "Triton %s): attention uses sdpa",
            dtype,
            block_size or "auto",
            torch.__version__,
            "imports" if offers.triton else "missing",
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
    if name == "triton":
        return TritonBackend(block_size, device, dtype)
    if name == "cpu-kernel":
        if not DecodeKernel.applies(block_size, head_dim, dtype, device):
            raise ValueError(
                f"the cpu-kernel attention backend needs float32 or bfloat16 on the CPU, {KERNEL_BLOCK_SIZE}-token "
                f"blocks and a head dim that is a multiple of 16; got {dtype} on {device}, block size "
                f"{block_size}, head dim {head_dim}"
            )
        kernel = load_decode_kernel()
        if kernel is None:
            raise ValueError("the cpu-kernel attention backend could not be built (no working C compiler): use sdpa")
        fresh = False
        if dtype == torch.bfloat16:
            fresh, kernel_s, sdpa_s = kernel_wins_fresh_chunks(kernel, head_dim)
            log.info("fresh bfloat16 chunks attend through %s (a %d-token chunk: kernel %.2f ms, sdpa %.2f ms)",
                     "the kernel" if fresh else "sdpa", PROBE_TOKENS, 1e3 * kernel_s, 1e3 * sdpa_s)  # fmt: skip
        return CpuKernelBackend(block_size, device, dtype, kernel, fresh)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = [
    "GRAPHED_BY_DEFAULT",
    "VARLEN_BACKENDS",
    "AttentionBackend",
    "Offers",
    "choose_backend",
    "default_block_size",
    "make_backend",
]
