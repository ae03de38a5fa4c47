"""The `triton` backend's kernel against `flash-reference`'s `varlen_attn` twin over random page pools, in Triton's
interpreter on the CPU (tests/conftest.py sets ``TRITON_INTERPRET=1``); the backend's refusals; and the kernel
compiled, not run, for an H100/H200 (sm_90) with the installed Triton.

Cases: decode steps, first chunks (nothing cached) and chunks after cached context, GQA ratios 1 to 8, context
lengths on and around page edges, sliding windows, a query that sees no key, pages of 16 and 32 tokens, a head
dim that is not a power of two; each with the CPU's tiles and with the tiles a GPU launch takes (32-key tiles,
so the key loop turns several times). Tolerances: float32 1e-5; float16 2e-3 against the reference computed in
float32 from the same float16 inputs (the kernel rounds probabilities to float16 before the value product, as
FlashAttention does, and its output to float16).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from services.models.varlen_attention import varlen_attn_reference
from services.worker.engine.attention import make_backend
from services.worker.engine.attention.triton_kernel import tiles_for, triton_varlen_attn

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    contexts: tuple[int, ...]
    heads: int
    kv_heads: int
    page: int = 16
    head_dim: int = 16
    window: tuple[int, int] = (-1, 0)


CASES = {
    "decodes-gqa4": Case((1, 1, 1, 1, 1), (1, 15, 16, 17, 33), 8, 2, window=(-1, -1)),
    "decodes-causal-mha": Case((1, 1, 1), (31, 32, 64), 2, 2),
    "chunks-gqa8": Case((7, 16, 1, 20), (7, 40, 16, 20), 8, 1),  # 7 and 20 cache nothing; 16 follows 24 cached
    "chunks-gqa3-page32-dim24": Case((5, 33, 1), (37, 33, 65), 6, 2, page=32, head_dim=24),
    "window-gqa2": Case((1, 12, 3), (50, 30, 3), 4, 2, window=(5, 0)),
    "unseen-queries": Case((3, 1), (1, 2), 2, 1),  # queries before the context's first key see nothing: zeros
}


def random_pool(case: Case, dtype: torch.dtype, seed: int):
    """A shuffled pool of each sequence's pages (and spare pages nobody owns), queries, and the call's arguments."""
    gen = torch.Generator().manual_seed(seed)
    pages_each = [-(-ctx // case.page) for ctx in case.contexts]
    width = max(pages_each) + 1
    total = sum(pages_each) + 3
    order = torch.randperm(total, generator=gen).to(torch.int32)
    table = torch.full((len(case.contexts), width), int(order[-1]), dtype=torch.int32)  # padding: some page
    used = 0
    for i, n in enumerate(pages_each):
        table[i, :n] = order[used : used + n]
        used += n
    shape = (total, case.page, case.kv_heads, case.head_dim)
    key = torch.randn(shape, generator=gen).to(dtype)
    value = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(case.q_lens), case.heads, case.head_dim, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(case.contexts).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, key, value, cu_q, cu_k, max(case.q_lens), max(case.contexts))
    kwargs = {"scale": 0.3, "window_size": case.window, "enable_gqa": case.heads != case.kv_heads,
              "seqused_k": torch.tensor(case.contexts, dtype=torch.int32), "block_table": table}  # fmt: skip
    return args, kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_flash_reference(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    args, kwargs = random_pool(case, dtype, seed=len(name))
    upcast = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    expected = varlen_attn_reference(*upcast, **kwargs)
    group = case.heads // case.kv_heads
    for device in (CPU, CUDA):  # the interpreter's tiles, then a GPU launch's (several key tiles a program)
        got = triton_varlen_attn(*args, **kwargs, tiles=tiles_for(max(case.q_lens), group, device))
        assert got.dtype == dtype and got.shape == args[0].shape
        error = float((got.float() - expected).abs().max())
        assert error <= TOLERANCE[dtype], f"{name} {dtype} tiles for {device}: max abs error {error}"
    if name == "unseen-queries":
        assert torch.equal(got[:2].float(), torch.zeros_like(got[:2].float()))


def test_backend_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        make_backend("triton", 24, CPU, torch.float32, 16)
    with pytest.raises(ValueError, match="interpreter"):
        make_backend("triton", 16, CPU, torch.bfloat16, 16)  # the interpreter's bf16 dot is wrong
    assert make_backend("triton", 48, CPU, torch.float16, 16).block_size == 48
    args, kwargs = random_pool(CASES["decodes-causal-mha"], torch.float32, seed=0)
    with pytest.raises(ValueError, match="block_table and seqused_k are required"):
        triton_varlen_attn(*args, **{**kwargs, "block_table": None})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="on CUDA, or on the CPU under TRITON_INTERPRET=1"):
        make_backend("triton", 16, CPU, torch.float32, 16)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from services.worker.engine.attention import triton_kernel as k

ints = ["scale", "num_seqs", "table_stride", "q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h",
        "kv_stride_block", "kv_stride_slot", "kv_stride_head", "window_left", "window_right"]
pointers = {n: "*bf16" for n in ("out", "query", "key_pool", "value_pool")}
pointers |= {n: "*i32" for n in ("cu_seq_q", "seqused_k", "block_table")}
for max_q in (1, 64):
    tiles = k.tiles_for(max_q, 7, __import__("torch").device("cuda"))  # Qwen2-VL-7B: 28 heads over 4
    constants = dict(HEAD_DIM=128, HEAD_PAD=128, GROUP=7, PAGE=16, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m,
                     BLOCK_N=tiles.block_n, ONE_QUERY=max_q == 1, PRECISION="tf32")
    signature = pointers | {n: "fp32" if n == "scale" else "i32" for n in ints} | dict.fromkeys(constants, "constexpr")
    source = ASTSource(fn=k._paged_attention, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tiles.num_warps})
    assert "cubin" in compiled.asm, compiled.asm.keys()
print("compiled", triton.__version__)
"""


def test_kernel_compiles_for_sm90() -> None:
    """What the interpreter does not check (types through loops and branches, the dot's shapes) is checked by
    compiling for the GPU; no GPU is needed to compile. In a process of its own: outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
