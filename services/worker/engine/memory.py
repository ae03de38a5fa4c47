"""The KV budget on CUDA, from the device's memory: utilisation x total, less what the model needs to run.

After the weights are loaded, a warm-up step at the largest step size (``max_num_batched_tokens`` tokens,
logits for ``max_num_seqs`` rows) shows the peak memory torch allocates; memory other processes or
non-torch allocations (the CUDA context, NCCL) hold is what the device reports in use beyond torch's
reservations. KV gets ``total x utilisation - peak - other - embeddings`` (the embeddings the worker holds
count against the same budget). vLLM sizes its KV cache the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes on one device: its total, torch's peak during the warm-up, and memory used outside torch."""

    total: int
    peak: int
    other: int


def kv_budget(profile: MemoryProfile, utilization: float, embedding_bytes: int) -> int:
    """Bytes left for KV; ValueError (with the numbers) when nothing is left."""
    budget = int(profile.total * utilization) - profile.peak - profile.other - embedding_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {profile.total / gib:.1f} GiB minus the model's "
            f"peak {profile.peak / gib:.1f} GiB, {profile.other / gib:.1f} GiB used outside torch and "
            f"{embedding_bytes / gib:.2f} GiB for embeddings; raise EPD_GPU_MEMORY_UTILIZATION or lower "
            f"EPD_MAX_NUM_BATCHED_TOKENS"
        )
    return budget


def profile_cuda(device: torch.device, warm_up: Callable[[], None]) -> MemoryProfile:
    """Run ``warm_up`` on ``device`` and measure (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warm_up()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    other = max(total - free - torch.cuda.memory_reserved(device), 0)
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, peak=peak, other=other)
