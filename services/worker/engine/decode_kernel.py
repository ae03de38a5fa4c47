"""The CPU decode-attention kernel (``decode_kernel.c``): built on this machine, loaded with ctypes.

Single-token queries attend to their KV blocks in place: no gathered copy of the context, no padding
computed, one call per decode group and layer (a prefill chunk's tokens are rows of their own, each over its
causal context). On the tiny test model it is about 4x faster than
gathering blocks and calling SDPA, on 128-dim heads about 5x (docs/engine.md). Used when the engine runs
float32 or bfloat16 on the CPU with 16-token blocks and a C compiler is found; otherwise attention stays on SDPA.

The shared object is compiled once per source, compiler and CPU (``-march=native``) into a cache folder and
reused (native_library.py).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
from pathlib import Path

import torch

from services.worker.engine.native_library import load_library

BLOCK_SIZE = 16
"""Tokens per KV block the kernel is built for (the engine's default)."""
KV_DTYPES = (torch.float32, torch.bfloat16)
"""What the cache may hold; a bfloat16 cache is widened to float32 as it is read (all arithmetic is float32)."""

SOURCE = Path(__file__).with_suffix(".c")


class DecodeKernel:
    """``kernel(q, keys, values, tables, lengths, scale)``: paged attention of single-token queries.

    Shapes: ``q [heads, batch, head_dim]`` (last dim contiguous), ``keys [kv_heads, blocks, head_dim, 16]``,
    ``values [kv_heads, blocks, 16, head_dim]``, ``tables [batch * width]`` int64 block ids row-major,
    ``lengths [batch]`` int64 context lengths; returns ``[batch, heads, head_dim]`` in the cache's dtype (keys and
    values float32 or bfloat16, both the same; ``q`` any float dtype).
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.epd_decode_attention
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        bf16 = ctypes.c_int  # the cache holds bfloat16 (1) or float32 (0)
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, bf16]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def applies(block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the kernel handles this engine's KV: float32 or bfloat16 on the CPU, 16-token blocks, head dims
        % 16 == 0."""
        return device.type == "cpu" and dtype in KV_DTYPES and block_size == BLOCK_SIZE and head_dim % 16 == 0

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        heads, batch, head_dim = q.shape
        kv_heads, num_blocks = keys.shape[0], keys.shape[1]
        if keys.dtype not in KV_DTYPES or values.dtype != keys.dtype:
            raise ValueError(f"decode kernel: a {keys.dtype} / {values.dtype} cache (float32 or bfloat16, both alike)")
        width = tables.numel() // batch
        if q.dtype != torch.float32 or q.stride(-1) != 1:
            q = q.float().contiguous()  # the products are float32 whatever the cache holds
        out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
        bf16 = keys.dtype == torch.bfloat16

        def rows(lo: int, hi: int) -> int:
            """Rows ``[lo, hi)``; the call releases the GIL (ctypes), so two threads' calls run at once."""
            scratch = torch.empty(heads // kv_heads * width * BLOCK_SIZE, dtype=torch.float32)  # one per call
            return self._fn(
                q.data_ptr() + lo * q.stride(1) * 4, q.stride(0), q.stride(1), keys.data_ptr(), values.data_ptr(),
                tables.data_ptr() + lo * width * 8, width, lengths.data_ptr() + lo * 8, hi - lo, heads, kv_heads,
                num_blocks, head_dim, scale, out.data_ptr() + lo * heads * head_dim * 4, scratch.data_ptr(), bf16,
            )  # fmt: skip

        split = _split_row(lengths) if batch >= SPLIT_ROWS and torch.get_num_threads() > 1 else batch
        if split in (0, batch):
            rc = rows(0, batch)
        else:  # the second half on the helper thread, the first here (lengths ascend: the split balances work)
            second = _helper().submit(rows, split, batch)
            rc = rows(0, split) | second.result()
        if rc != 0:
            raise ValueError(f"decode kernel: unsupported shapes (heads {heads}, kv heads {kv_heads}, dim {head_dim})")
        return out if keys.dtype == torch.float32 else out.to(keys.dtype)


SPLIT_ROWS = 256
"""Rows from which a call is split over two threads when torch runs more than one: a prefill chunk of a large step
(step_threads.py's 256 tokens). A decode group (at most ``max_num_seqs`` rows, 64 by default) stays on one thread
even where the process runs several: splitting a 16-row decode step's calls made it slower (3.8 -> 4.3 ms, the
hand-over per layer)."""


def _split_row(lengths: torch.Tensor) -> int:
    """The row that halves the work (the sum of context lengths) of rows ``lengths``."""
    total = lengths.cumsum(0)
    return int(torch.searchsorted(total, total[-1] // 2))


@functools.cache
def _helper() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that computes the second half of a split call."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-attention")


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, compiled on first use (cached on disk, native_library.py), or None when it cannot be built."""
    library = load_library(SOURCE)
    return None if library is None else DecodeKernel(library)
