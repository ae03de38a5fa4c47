"""The GPU check's sections: each fills ``out`` as it goes, so what it measured survives a later failure."""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from services.models.base import PixelInputs
from services.models.varlen_attention import flash_supports, torch_varlen_attn, varlen_attn_reference
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.gpu import workload as w


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the real GPU run, or the CPU dry run."""

    device: str
    decode_batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    lm_width: int | None  # None: the 7B's language model; else a tiny one this wide
    vision_7b: bool
    image_size: tuple[int, int]
    images_per_call: int


GPU = Plan("cuda", (1, 32, 128), 128, 64, None, True, (1344, 1008), 8)
DRY = Plan("cpu", (1, 4, 8), 24, 6, 128, False, (224, 168), 2)


def env(plan: Plan, out: dict[str, Any]) -> None:
    import transformers

    device = torch.device(plan.device)
    out.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
               device=plan.device, varlen_attn_block_table=torch_varlen_attn() is not None)  # fmt: skip
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError as exc:
        out["varlen_attn_signature"] = f"missing: {exc}"
    out["aten_flash_schema"] = str(torch.ops.aten._flash_attention_forward.default._schema)
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["flash_bf16"] = flash_supports(device, torch.bfloat16)


def kernel(plan: Plan, out: dict[str, Any]) -> None:
    """torch's varlen_attn against the reference on one random pool of 256-token pages: a mixed step and a
    decode-only one (the window the engine passes for each)."""
    device = torch.device(plan.device)
    if not flash_supports(device, torch.bfloat16):
        out["skipped"] = "no paged FlashAttention here (CPU, or torch without varlen_attn block_table)"
        return
    pages, page, kv_heads, heads, dim = 64, 256, 4, 28, 128
    key = torch.randn(pages, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    table = torch.randperm(pages, device=device, dtype=torch.int32)[:20].view(5, 4).contiguous()
    for name, q_lens, window in (("mixed", [1, 1, 7, 300, 1], (-1, 0)), ("decode", [1] * 5, (-1, -1))):
        ctx = [900, 256, 513, 300, 1]
        query = torch.randn(sum(q_lens), heads, dim, device=device, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *_cumsum(ctx)], dtype=torch.int32, device=device)
        used = torch.tensor(ctx, dtype=torch.int32, device=device)
        args = (query, key, value, cu_q, cu_k, max(q_lens), max(ctx))
        kwargs = {"window_size": window, "enable_gqa": True, "seqused_k": used, "block_table": table}
        fast = torch_varlen_attn()(*args, **kwargs)
        slow = varlen_attn_reference(*args, **kwargs)
        out[f"{name}_max_abs_diff_bf16"] = float((fast.float() - slow.float()).abs().max())


def exactness(plan: Plan, out: dict[str, Any]) -> None:
    """Greedy tokens of 16 concurrent mixed requests through the engine (the flash path's twin with decode graphs
    captured, then ``auto``) against ``generate`` for each alone, fp32; with the kernel, bf16 agreement too."""
    device = torch.device(plan.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, adapter = w.tiny_model(device, torch.float32, width=64, layers=2)
    gen = torch.Generator().manual_seed(1)
    prompts = [w.mixed_prompt(adapter, model, i, gen) for i in range(16)]
    references = [w.generate_reference(model, p, 12) for p in prompts]
    on_gpu = device.type == "cuda"
    base = EngineConfig(device=plan.device, max_num_batched_tokens=64, max_num_seqs=16, kv_cache_bytes=64 << 20,
                        max_model_len=2048)  # fmt: skip
    twin = {"attention_backend": "flash-reference", "cuda_graphs": "on" if on_gpu else "eager"}
    variants = {"flash_reference_graphs": twin, "auto": {"attention_backend": "auto"}}
    for name, settings in variants.items():
        try:
            engine = Engine(adapter, model, dataclasses.replace(base, **settings))
            tokens = w.run_engine(engine, prompts, 12, tag=name)
            graphs = engine.runner.graphs
            out[name] = _agreement(tokens, references) | {
                "backend": engine.config.attention_backend, "block_size": engine.config.block_size,
                "graphs": engine.config.cuda_graphs, "graph_steps": graphs.steps if graphs else 0,
            }  # fmt: skip
        except Exception as exc:  # the other variant still reports
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        engine = None
        w.free(device)
    if flash_supports(device, torch.bfloat16):
        out["flash_vs_reference_bf16"] = _flash_agreement(model, adapter, prompts)


def _agreement(tokens: list[list[int]], references: list[w.Reference]) -> dict[str, Any]:
    exact = [i for i, (got, ref) in enumerate(zip(tokens, references, strict=True)) if got == ref.tokens]
    ties = [i for i, (got, ref) in enumerate(zip(tokens, references, strict=True))
            if i not in exact and w.diverges_at_tie(got, ref)]  # fmt: skip
    wrong = [i for i in range(len(tokens)) if i not in exact and i not in ties]
    return {"requests": len(tokens), "exact": len(exact), "ties": len(ties), "wrong": wrong}


def _flash_agreement(model: Any, adapter: Any, prompts: list[w.Prompt]) -> dict[str, Any]:
    """bf16: the flash backend's greedy tokens against flash-reference's on the same 256-token-block engine."""
    model = model.to(torch.bfloat16)
    prompts = [dataclasses.replace(p, embeddings=[e.to(torch.bfloat16) for e in p.embeddings]) for p in prompts]
    answers = {}
    for backend in ("flash", "flash-reference"):
        config = EngineConfig(device="cuda", dtype="bfloat16", attention_backend=backend, block_size=256,
                              kv_cache_bytes=64 << 20, max_num_batched_tokens=64, max_num_seqs=16, max_model_len=2048,
                              cuda_graphs="on")  # fmt: skip
        answers[backend] = w.run_engine(Engine(adapter, model, config), prompts, 12, tag=backend)
    same = sum(a == b for a, b in zip(answers["flash"], answers["flash-reference"], strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
             for a, b in zip(answers["flash"], answers["flash-reference"], strict=True)]  # fmt: skip
    return {"identical_requests": same, "of": len(prompts), "first_difference_at": first}


def decode(plan: Plan, out: dict[str, Any]) -> None:
    """bf16 decode: the engine against generate's static batches; its decode step against the bare replay."""
    device = torch.device(plan.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model, adapter = (
        w.seven_b(device, dtype) if plan.lm_width is None else w.tiny_model(device, dtype, plan.lm_width, 4)
    )
    out.update(dtype=str(dtype).removeprefix("torch."), prompt_tokens=plan.prompt_tokens, new_tokens=plan.new_tokens)
    gen = torch.Generator().manual_seed(2)
    limit = w.text_id_limit(model)
    batches = {b: [w.random_ids(gen, plan.prompt_tokens, limit) for _ in range(b)] for b in plan.decode_batches}
    baseline = {}
    for b, ids in batches.items():
        try:
            baseline[b] = w.generate_timed(model, ids, plan.new_tokens)
        except Exception as exc:  # e.g. out of memory at the largest batch: the others still report
            out[f"batch_{b}"] = {"generate_error": f"{type(exc).__name__}: {exc}"[:600]}
        w.free(device)
    # the CPU dry run takes the GPU's path: the varlen call, 256-token blocks, padded graph steps (eagerly)
    base = EngineConfig(
        device=plan.device, dtype=dtype, max_num_seqs=max(plan.decode_batches), max_num_batched_tokens=4096,
        gpu_memory_utilization=0.85, kv_cache_bytes=0 if on_gpu else 64 << 20, max_model_len=1024,
        attention_backend="auto" if on_gpu else "flash-reference", block_size=0 if on_gpu else 256,
        cuda_graphs="auto" if on_gpu else "eager",
    )  # fmt: skip
    engine = _working_engine(adapter, model, base, out)
    out.update(backend=engine.config.attention_backend, block_size=engine.config.block_size,
               kv_blocks=engine.runner.num_blocks, kv_bytes=engine.config.kv_cache_bytes,
               graphs=engine.config.cuda_graphs)  # fmt: skip
    if on_gpu:
        out["memory_reserved_gib"] = round(torch.cuda.memory_reserved(device) / 2**30, 2)
    for b, ids in batches.items():
        figures = out.setdefault(f"batch_{b}", {})
        try:
            figures.update(_compare(w.engine_timed(engine, ids, plan.new_tokens, tag=f"b{b}-"), baseline.get(b)))
        except Exception as exc:
            figures["engine_error"] = f"{type(exc).__name__}: {exc}"[:600]
    out["syncs_per_step"] = _syncs_per_step(engine, [w.random_ids(gen, plan.prompt_tokens, limit) for _ in range(8)],
                                            plan.new_tokens)  # fmt: skip
    out["staging_waits"] = engine.runner.io.waits


def _compare(timed: w.Timed, hf: w.Timed | None) -> dict[str, Any]:
    figures = {"engine_tok_s": _round(timed.tokens_per_s, 1), "engine_itl_ms": _round(timed.itl_s * 1e3, 3),
               "engine_itl_p99_ms": _round(timed.itl_p99_s * 1e3, 3)}  # fmt: skip
    if timed.bare_step_s is not None:
        figures["bare_step_ms"] = _round(timed.bare_step_s * 1e3, 3)
        figures["overhead_ratio"] = _round(timed.itl_s / timed.bare_step_s, 3)
    if hf is not None:
        figures.update(generate_tok_s=_round(hf.tokens_per_s, 1), generate_itl_ms=_round(hf.itl_s * 1e3, 3),
                       throughput_ratio=_round(timed.tokens_per_s / hf.tokens_per_s, 2))  # fmt: skip
    return figures


def _working_engine(adapter: Any, model: Any, config: EngineConfig, out: dict[str, Any]) -> Engine:
    """An engine with ``config`` that serves a request; failing that (recorded in ``out["fallbacks"]``) the same
    without decode graphs, then with ``sdpa``: one run reports as much as it can."""
    variants = [config, dataclasses.replace(config, cuda_graphs="off"),
                dataclasses.replace(config, cuda_graphs="off", attention_backend="sdpa", block_size=0)]  # fmt: skip
    for variant in variants:
        engine = None
        try:
            engine = Engine(adapter, model, variant)
            engine.add_request(EngineRequest("smoke", [1, 2, 3, 4], [], SamplingOptions(max_tokens=3, ignore_eos=True)))
            while engine.has_work():
                engine.step()
            return engine
        except Exception as exc:  # free what it holds (its KV), then try a plainer engine
            out.setdefault("fallbacks", []).append(f"{variant.attention_backend}/{variant.cuda_graphs}: {exc!r}"[:600])
            engine = None
            w.free(torch.device(config.device))
    raise RuntimeError("no engine variant could serve a request")


def _syncs_per_step(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Host synchronisations CUDA reports per engine step (``set_sync_debug_mode``): one is the sampled ids. Every
    other request is seeded with every logits processor (penalties, bad words, bias, min_tokens) and min-p."""
    if engine.runner.device.type != "cuda":
        return {"skipped": "CUDA only (the CPU test counts host reads instead: tests/unit/test_host_sync.py)"}
    processed = SamplingOptions(max_tokens=new_tokens, ignore_eos=True, temperature=0.8, seed=1, min_p=0.05,
                                repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, min_tokens=2,
                                bad_words=((5,), (6, 7)), logit_bias=((8, 1.0),))  # fmt: skip
    for i, ids in enumerate(prompts):
        sampling = processed if i % 2 else SamplingOptions(max_tokens=new_tokens, ignore_eos=True)
        engine.add_request(EngineRequest(f"sync-{i}", ids, [], sampling))
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_work():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            counts.append(sum("synchroniz" in str(m.message) for m in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"steps": len(counts), "max": max(counts), "mean": round(sum(counts) / len(counts), 2)}


def vision(plan: Plan, out: dict[str, Any]) -> None:
    """Images/s of the vision tower and projector, ``images_per_call`` images per forward, with the encoder's
    attention choice for this device."""
    from services.models.vision_attention import install_vision_attention

    device = torch.device(plan.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, adapter = w.seven_b(device, dtype, text_layers=1) if plan.vision_7b else w.tiny_model(device, dtype, 64, 1)
    try:
        out["attention"] = install_vision_attention(model, "auto")
    except Exception as exc:  # a transformers that refuses the name: transformers' own per-image path
        out["attention"], out["attention_error"] = "sdpa", f"{type(exc).__name__}: {exc}"[:600]
    width, height = plan.image_size
    grid = (1, height // 14 // 2 * 2, width // 14 // 2 * 2)
    items = [PixelInputs(torch.randn(grid[1] * grid[2], 3 * 2 * 14 * 14), grid) for _ in range(plan.images_per_call)]
    out.update(image=f"{width}x{height}", grid_thw=list(grid), tokens_per_image=grid[1] * grid[2] // 4)
    adapter.encode(model, items)  # warm-up
    out["planned"] = adapter._vision_planning
    w.sync(device)
    calls = 3
    started = time.perf_counter()
    for _ in range(calls):
        adapter.encode(model, items)
    w.sync(device)
    out["images_per_s"] = round(calls * len(items) / (time.perf_counter() - started), 2)


def _round(value: float, digits: int) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


SECTIONS = {"env": env, "kernel": kernel, "exactness": exactness, "decode": decode, "vision": vision}
