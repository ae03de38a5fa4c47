"""The compiled CPU decode-attention kernel (float32 and bfloat16 caches) against SDPA over the same blocks
gathered, and where it applies."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.decode_kernel import BLOCK_SIZE, SOURCE, DecodeKernel, load_decode_kernel
from services.worker.engine.native_library import build_library


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    loaded = load_decode_kernel()
    assert loaded is not None, "the decode kernel must build here (a C compiler is part of this machine)"
    return loaded


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[list[int]], lengths: list[int]):
    """Per row: its blocks gathered in order, cut to its length, one SDPA call; ``[batch, heads, dim]``."""
    heads, _, dim = q.shape
    kv_heads = keys.shape[0]
    out = []
    for b, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        ids = torch.tensor(table)
        k = keys.index_select(1, ids).transpose(2, 3).reshape(kv_heads, -1, dim)[:, :length]
        v = values.index_select(1, ids).reshape(kv_heads, -1, dim)[:, :length]
        row = F.scaled_dot_product_attention(q[:, b : b + 1][None], k[None], v[None], enable_gqa=True)
        out.append(row[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (2, 2, 32), (12, 2, 128), (7, 1, 64)], ids=str)
def test_matches_sdpa_over_gathered_blocks(kernel: DecodeKernel, heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    num_blocks = 97
    keys = torch.randn(kv_heads, num_blocks, dim, BLOCK_SIZE, generator=gen)
    values = torch.randn(kv_heads, num_blocks, BLOCK_SIZE, dim, generator=gen)
    lengths = [1, 15, 16, 17, 32, 33, 100, 250, 7]  # block edges, a single token, several blocks
    width = max(-(-n // BLOCK_SIZE) for n in lengths)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks, no block shared
    tables, used = [], 0
    for n in lengths:
        need = -(-n // BLOCK_SIZE)
        tables.append(order[used : used + need])
        used += need
    flat = torch.tensor([t + [0] * (width - len(t)) for t in tables]).view(-1)  # padded with block 0
    # the queries are rows of a wider step, as in a flattened batch: strided, not contiguous
    step = torch.randn(heads, len(lengths) + 3, dim, generator=gen) * 3
    q = step[:, 2 : 2 + len(lengths)]
    got = kernel(q, keys, values, flat, torch.tensor(lengths), dim**-0.5)
    expected = reference(q, keys, values, tables, lengths)
    # float32 sums over up to 250 tokens: the kernel and SDPA add in different orders (and -march=native picks
    # the vector width), so they agree to rounding, ~1e-6 here; a wrong block, length or scale is off by >1e-2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (7, 1, 16)], ids=str)
def test_bfloat16_cache_matches_sdpa_over_the_same_values(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int
) -> None:
    """A bfloat16 cache is read as the float32 values it holds: the same answer as the float32 kernel and as SDPA
    on those values widened (to float32 rounding), returned in bfloat16; a bfloat16 query is widened too."""
    gen = torch.Generator().manual_seed(dim)
    keys = torch.randn(kv_heads, 20, dim, BLOCK_SIZE, generator=gen).to(torch.bfloat16)
    values = torch.randn(kv_heads, 20, BLOCK_SIZE, dim, generator=gen).to(torch.bfloat16)
    lengths, tables = [5, 16, 70], [[3], [7], [1, 9, 4, 12, 0]]
    flat = torch.tensor([t + [0] * (5 - len(t)) for t in tables]).view(-1)
    q = (torch.randn(heads, 3, dim, generator=gen) * 2).to(torch.bfloat16)
    got = kernel(q, keys, values, flat, torch.tensor(lengths), dim**-0.5)
    assert got.dtype == torch.bfloat16
    wide = kernel(q.float(), keys.float(), values.float(), flat, torch.tensor(lengths), dim**-0.5)
    assert torch.equal(got, wide.to(torch.bfloat16))  # the same float32 arithmetic, rounded once at the end
    expected = reference(q.float(), keys.float(), values.float(), tables, lengths)
    torch.testing.assert_close(wide, expected, rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow(kernel: DecodeKernel) -> None:
    """Softmax subtracts the row's maximum: scores in the thousands stay finite and exact."""
    keys = torch.zeros(1, 4, 16, BLOCK_SIZE)
    keys[0, 1, :, 3] = 50.0  # one token far above the rest
    values = torch.arange(4 * BLOCK_SIZE * 16, dtype=torch.float32).view(1, 4, BLOCK_SIZE, 16)
    q = torch.full((2, 1, 16), 10.0)
    got = kernel(q, keys, values, torch.tensor([0, 1, 2]), torch.tensor([40]), 1.0)
    torch.testing.assert_close(got[0, 0], values[0, 1, 3])
    assert torch.isfinite(got).all()


def test_unsupported_heads_and_dtypes_raise(kernel: DecodeKernel) -> None:
    keys = torch.zeros(3, 2, 16, BLOCK_SIZE)
    values = torch.zeros(3, 2, BLOCK_SIZE, 16)
    with pytest.raises(ValueError, match="unsupported shapes"):
        kernel(torch.zeros(4, 1, 16), keys, values, torch.tensor([0]), torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match="float16 cache"):  # never read as if it were float32
        kernel(torch.zeros(3, 1, 16), keys.half(), values.half(), torch.tensor([0]), torch.tensor([1]), 1.0)


def test_applies_only_to_float32_or_bfloat16_cpu_16_token_blocks() -> None:
    cpu = torch.device("cpu")
    assert DecodeKernel.applies(16, 128, torch.float32, cpu)
    assert DecodeKernel.applies(16, 128, torch.bfloat16, cpu)
    assert not DecodeKernel.applies(32, 128, torch.float32, cpu)
    assert not DecodeKernel.applies(16, 8, torch.float32, cpu)
    assert not DecodeKernel.applies(16, 128, torch.float16, cpu)
    assert not DecodeKernel.applies(16, 128, torch.float32, torch.device("cuda"))


def test_builds_into_an_empty_folder_and_reuses_it(tmp_path: Path, kernel: DecodeKernel) -> None:
    """A fresh machine's path: compile into the cache folder, then find it there; a broken compiler is None."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    built = build_library(SOURCE, compiler, tmp_path)
    assert built is not None and built.parent == tmp_path
    mtime = built.stat().st_mtime_ns
    assert build_library(SOURCE, compiler, tmp_path) == built and built.stat().st_mtime_ns == mtime
    fresh = DecodeKernel(ctypes.CDLL(str(built)))
    keys, values = torch.randn(2, 3, 16, BLOCK_SIZE), torch.randn(2, 3, BLOCK_SIZE, 16)
    q, tables, lengths = torch.randn(4, 2, 16), torch.tensor([2, 0, 1, 1, 0, 2]), torch.tensor([40, 20])
    expected = kernel(q, keys, values, tables, lengths, 0.25)
    torch.testing.assert_close(fresh(q, keys, values, tables, lengths, 0.25), expected)
    broken = tmp_path / "broken"
    broken.mkdir()
    assert build_library(SOURCE, "false", broken) is None
    assert not any(broken.iterdir())  # no partial file left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_vector_widths_give_the_same_bits(tmp_path: Path, dtype: torch.dtype) -> None:
    """The kernel built with 8-lane vectors (AVX2's register) and with 16-lane ones (AVX-512's; -march=native picks
    by the CPU) computes every lane and every sum in the same order: equal outputs on GQA groups odd and even,
    head dims 16-128, lengths at block edges. Either build runs on any x86 CPU (a 16-lane one slowly on AVX2). So
    does a build that scores one block at a time (``BLK=1``) instead of ``BLK`` blocks together."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    source = Path(__file__).parents[2] / "services/worker/engine/decode_kernel.c"
    kernels = []
    for lanes, blocks in ((8, ""), (16, ""), (16, "-DBLK=1")):
        target = tmp_path / f"lanes{lanes}{blocks}.so"
        flags = ["-O3", "-march=native", "-fPIC", "-shared", f"-DVL={lanes}", *([blocks] if blocks else [])]
        subprocess.run([compiler, *flags, "-o", str(target), str(source)], check=True, capture_output=True)
        kernels.append(DecodeKernel(ctypes.CDLL(str(target))))
    gen = torch.Generator().manual_seed(7)
    for heads, kv_heads, dim in [(4, 2, 64), (7, 1, 16), (6, 3, 32), (12, 2, 128)]:
        keys = torch.randn(kv_heads, 40, dim, BLOCK_SIZE, generator=gen).to(dtype)
        values = torch.randn(kv_heads, 40, BLOCK_SIZE, dim, generator=gen).to(dtype)
        lengths, tables = [1, 16, 17, 100], [[3], [7], [1, 9], [0, 2, 4, 5, 6, 8, 10]]  # 7 blocks: BLK and a rest
        flat = torch.tensor([t + [11] * (7 - len(t)) for t in tables]).view(-1)
        q = (torch.randn(heads, 4, dim, generator=gen) * 3).to(dtype)
        eight, sixteen, one_block = (k(q, keys, values, flat, torch.tensor(lengths), dim**-0.5) for k in kernels)
        assert torch.equal(eight, sixteen), (heads, kv_heads, dim)
        assert torch.equal(one_block, sixteen), (heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_call_split_over_two_threads_gives_the_same_bits(
    kernel: DecodeKernel, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk in the kernel's form (row r over its first r + 1 tokens, strided queries): with two torch
    threads the rows are split at half the work, the second part on the helper thread, with the same output
    bits as one call on one thread; a call of fewer than `SPLIT_ROWS` rows is not split."""
    from services.worker.engine import decode_kernel

    gen = torch.Generator().manual_seed(7)
    rows, heads, kv_heads, dim = 300, 4, 2, 64
    blocks = -(-rows // BLOCK_SIZE)
    keys = torch.randn(kv_heads, blocks + 2, dim, BLOCK_SIZE, generator=gen).to(dtype)
    values = torch.randn(kv_heads, blocks + 2, BLOCK_SIZE, dim, generator=gen).to(dtype)
    q = (torch.randn(heads, rows + 5, dim, generator=gen) * 3)[:, 5:]
    tables = torch.arange(1, blocks + 1).repeat(rows)
    lengths = torch.arange(1, rows + 1)
    splits = []
    real = decode_kernel._split_row
    monkeypatch.setattr(decode_kernel, "_split_row", lambda n: splits.append(real(n)) or splits[-1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel(q, keys, values, tables, lengths, dim**-0.5)
        torch.set_num_threads(2)
        split = kernel(q, keys, values, tables, lengths, dim**-0.5)
        few = decode_kernel.SPLIT_ROWS - 1
        kernel(q[:, :few], keys, values, tables[: few * blocks], lengths[:few], dim**-0.5)
    finally:
        torch.set_num_threads(before)
    assert len(splits) == 1 and 0 < splits[0] < rows  # ~rows / sqrt(2): the later rows attend to more
    assert torch.equal(alone, split)


def test_the_fresh_chunk_probe_times_the_same_attention_both_ways(kernel: DecodeKernel) -> None:
    """What `kernel_wins_fresh_chunks` times is one attention: the kernel's rows and SDPA's causal call agree on the
    probe (bfloat16 outputs of float32 and bfloat16 products), and the choice comes with both times."""
    from services.worker.engine.attention.cpu_kernel import PROBE_TOKENS, fresh_chunk_probe, kernel_wins_fresh_chunks

    by_kernel, by_sdpa = (call() for call in fresh_chunk_probe(kernel, 64))
    assert by_kernel.shape == by_sdpa.shape == (PROBE_TOKENS, 4, 64)
    torch.testing.assert_close(by_kernel.float(), by_sdpa.float(), atol=2e-2, rtol=2e-2)
    wins, kernel_s, sdpa_s = kernel_wins_fresh_chunks(kernel, 64, repeats=2)
    assert wins == (kernel_s < sdpa_s) and kernel_s > 0 and sdpa_s > 0
