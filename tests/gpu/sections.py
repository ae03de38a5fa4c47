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
from services.worker.engine.attention import VARLEN_BACKENDS, make_backend
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.gpu import workload as w
from tests.gpu.structured import structured
from tests.gpu.tensor_parallel import tensor_parallel


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
    decode_backends: tuple[str, ...]  # each measured in turn, graphs on where it takes them
    bare_repeats: int  # replays of the bare decode step timed
    kernel_contexts: tuple[int, ...]  # the kernel section's context lengths (pages of 256 tokens on CUDA)
    exactness_triton: bool  # the exactness section runs the triton backend too


GPU = Plan("cuda", (1, 32, 128), 128, 64, None, True, (1344, 1008), 8, ("triton", "flash", "sdpa"), 20,
           (900, 256, 513, 300, 1), True)  # fmt: skip
DRY = Plan("cpu", (1, 4, 8), 24, 6, 128, False, (224, 168), 2, ("triton", "flash", "flash-reference", "sdpa"), 2,
           (60, 16, 33, 30, 1), False)  # fmt: skip
"""The dry run adds `flash-reference` (what `flash` runs, in pure torch) and reports `flash` skipped (no CUDA);
its `triton` runs in Triton's interpreter (run.sh sets ``TRITON_INTERPRET=1`` for ``--dry-run``), slowly: its
decode model has 2 layers, and its greedy exactness is the unit tests' (tests/unit/test_engine_exactness.py)."""


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
    """Each paged kernel that runs here (torch's ``varlen_attn``, our Triton kernel) against the pure-torch
    reference on one random pool of 256-token pages: a mixed step and a decode-only one (the window the engine
    passes for each); bf16 on CUDA, fp32 in the CPU dry run (the Triton interpreter's bf16 dot is wrong)."""
    device = torch.device(plan.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = {}
    if flash_supports(device, torch.bfloat16):
        kernels["flash"] = torch_varlen_attn()
    else:
        out["flash"] = {"skipped": "no paged FlashAttention here (CPU, or torch without varlen_attn block_table)"}
    try:
        make_backend("triton", 256, device, dtype, 128)  # raises where it cannot run
        from services.worker.engine.attention.triton_kernel import triton_varlen_attn

        kernels["triton"] = triton_varlen_attn
    except ValueError as exc:
        out["triton"] = {"skipped": str(exc)}
    contexts = list(plan.kernel_contexts)
    pages, page, kv_heads, heads, dim = 64, 256, 4, 28, 128
    if device.type != "cuda":
        pages, page, kv_heads, heads, dim = 24, 16, 2, 4, 16
    key = torch.randn(pages, page, kv_heads, dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    table = torch.randperm(pages, device=device, dtype=torch.int32)[:20].view(5, 4).contiguous()
    suffix = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
    for case, q_lens, window in (("mixed", [1, 1, 7, contexts[3], 1], (-1, 0)), ("decode", [1] * 5, (-1, -1))):
        query = torch.randn(sum(q_lens), heads, dim, device=device, dtype=dtype)
        cu_q = torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *_cumsum(contexts)], dtype=torch.int32, device=device)
        used = torch.tensor(contexts, dtype=torch.int32, device=device)
        args = (query, key, value, cu_q, cu_k, max(q_lens), max(contexts))
        kwargs = {"window_size": window, "enable_gqa": True, "seqused_k": used, "block_table": table}
        slow = varlen_attn_reference(*args, **kwargs).float()
        for name, fn in kernels.items():
            diff = float((fn(*args, **kwargs).float() - slow).abs().max())
            out.setdefault(name, {})[f"{case}_max_abs_diff_{suffix}"] = diff


def exactness(plan: Plan, out: dict[str, Any]) -> None:
    """Greedy tokens of 16 concurrent mixed requests through the engine (the flash path's twin with decode graphs
    captured, ``auto``, on the GPU the triton backend with graphs captured) against ``generate`` for each alone,
    fp32; on the GPU each kernel's bf16 tokens against the twin's too."""
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
    graphs = "on" if on_gpu else "eager"
    variants = {"flash_reference_graphs": {"attention_backend": "flash-reference", "cuda_graphs": graphs},
                "auto": {"attention_backend": "auto"}}  # fmt: skip
    if plan.exactness_triton:
        variants["triton_graphs"] = {"attention_backend": "triton", "cuda_graphs": graphs}
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
    if on_gpu:
        out.update(_bf16_agreement(model, adapter, prompts))


def _agreement(tokens: list[list[int]], references: list[w.Reference]) -> dict[str, Any]:
    exact = [i for i, (got, ref) in enumerate(zip(tokens, references, strict=True)) if got == ref.tokens]
    ties = [i for i, (got, ref) in enumerate(zip(tokens, references, strict=True))
            if i not in exact and w.diverges_at_tie(got, ref)]  # fmt: skip
    wrong = [i for i in range(len(tokens)) if i not in exact and i not in ties]
    return {"requests": len(tokens), "exact": len(exact), "ties": len(ties), "wrong": wrong}


def _bf16_agreement(model: Any, adapter: Any, prompts: list[w.Prompt]) -> dict[str, Any]:
    """bf16: each kernel's greedy tokens (flash where it runs, triton) against flash-reference's on the same
    256-token-block engine with decode graphs captured."""
    model = model.to(torch.bfloat16)
    prompts = [dataclasses.replace(p, embeddings=[e.to(torch.bfloat16) for e in p.embeddings]) for p in prompts]
    kernels = ["triton"] + (["flash"] if flash_supports(torch.device("cuda"), torch.bfloat16) else [])
    answers = {}
    for backend in ["flash-reference", *kernels]:
        config = EngineConfig(device="cuda", dtype="bfloat16", attention_backend=backend, block_size=256,
                              kv_cache_bytes=64 << 20, max_num_batched_tokens=64, max_num_seqs=16, max_model_len=2048,
                              cuda_graphs="on")  # fmt: skip
        try:
            answers[backend] = w.run_engine(Engine(adapter, model, config), prompts, 12, tag=backend)
        except Exception as exc:  # the other kernel still reports
            answers[backend] = f"{type(exc).__name__}: {exc}"[:600]
    reference = answers.pop("flash-reference")
    report = {}
    for backend, got in answers.items():
        key = f"{backend}_vs_reference_bf16"
        if isinstance(got, str) or isinstance(reference, str):
            report[key] = {"error": got if isinstance(got, str) else reference}
            continue
        same = sum(a == b for a, b in zip(got, reference, strict=True))
        first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
                 for a, b in zip(got, reference, strict=True)]  # fmt: skip
        report[key] = {"identical_requests": same, "of": len(prompts), "first_difference_at": first}
    return report


def decode(plan: Plan, out: dict[str, Any]) -> None:
    """bf16 decode: ``generate``'s static batches, then the engine with each of ``plan.decode_backends`` (decode
    graphs where the backend takes them): tokens/s against generate, its decode step against the bare replay.
    Every backend's figures sit under its name, with the backend, block size and graph mode that ran."""
    device = torch.device(plan.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model, adapter = (
        w.seven_b(device, dtype) if plan.lm_width is None else w.tiny_model(device, dtype, plan.lm_width, 2)
    )
    out.update(dtype=str(dtype).removeprefix("torch."), prompt_tokens=plan.prompt_tokens, new_tokens=plan.new_tokens)
    gen = torch.Generator().manual_seed(2)
    limit = w.text_id_limit(model)
    batches = {b: [w.random_ids(gen, plan.prompt_tokens, limit) for _ in range(b)] for b in plan.decode_batches}
    baseline = {}
    generate = out.setdefault("generate", {})
    for b, ids in batches.items():
        try:
            baseline[b] = w.generate_timed(model, ids, plan.new_tokens)
            generate[f"batch_{b}"] = {"tok_s": _round(baseline[b].tokens_per_s, 1),
                                      "itl_ms": _round(baseline[b].itl_s * 1e3, 3)}  # fmt: skip
        except Exception as exc:  # e.g. out of memory at the largest batch: the others still report
            generate[f"batch_{b}"] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        w.free(device)
    sync_prompts = [w.random_ids(gen, plan.prompt_tokens, limit) for _ in range(8)]
    for name in plan.decode_backends:
        entry = out.setdefault(name, {})
        try:
            _decode_backend(plan, name, adapter, model, batches, baseline, sync_prompts, entry)
        except _Unavailable as exc:
            entry["skipped"] = str(exc)[:600]
        except Exception as exc:  # the next backend still reports
            entry["error"] = f"{type(exc).__name__}: {exc}"[:800]
        w.free(device)


class _Unavailable(Exception):
    """The backend cannot run here (its refusal says why)."""


def _decode_backend(
    plan: Plan, name: str, adapter: Any, model: Any, batches: dict[int, list[list[int]]],
    baseline: dict[int, w.Timed], sync_prompts: list[list[int]], entry: dict[str, Any],
) -> None:  # fmt: skip
    on_gpu = plan.device == "cuda"
    varlen = name in VARLEN_BACKENDS
    config = EngineConfig(
        device=plan.device, dtype="bfloat16" if on_gpu else "float32", max_num_seqs=max(plan.decode_batches),
        max_num_batched_tokens=4096, gpu_memory_utilization=0.85, kv_cache_bytes=0 if on_gpu else 64 << 20,
        max_model_len=1024, attention_backend=name, block_size=256 if name == "flash-reference" else 0,
        cuda_graphs=("auto" if on_gpu else "eager") if varlen else "off",
    )  # fmt: skip
    engine = _working_engine(adapter, model, config, entry)
    entry.update(backend=engine.config.attention_backend, block_size=engine.config.block_size,
                 kv_blocks=engine.runner.num_blocks, kv_bytes=engine.config.kv_cache_bytes,
                 graphs=engine.config.cuda_graphs)  # fmt: skip
    if on_gpu:
        entry["memory_reserved_gib"] = round(torch.cuda.memory_reserved(engine.runner.device) / 2**30, 2)
    for b, ids in batches.items():
        figures = entry.setdefault(f"batch_{b}", {})
        try:
            timed = w.engine_timed(engine, ids, plan.new_tokens, tag=f"{name}-b{b}-", bare_repeats=plan.bare_repeats)
            figures.update(_compare(timed, baseline.get(b)))
        except Exception as exc:
            figures["engine_error"] = f"{type(exc).__name__}: {exc}"[:600]
    entry["syncs_per_step"] = _syncs_per_step(engine, sync_prompts, plan.new_tokens)
    entry["staging_waits"] = engine.runner.io.waits


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
    without decode graphs. A backend that refuses to run here raises `_Unavailable`."""
    variants = [config] if config.cuda_graphs == "off" else [config, dataclasses.replace(config, cuda_graphs="off")]
    for variant in variants:
        engine = None
        try:
            engine = Engine(adapter, model, variant)
            engine.add_request(EngineRequest("smoke", [1, 2, 3, 4], [], SamplingOptions(max_tokens=3, ignore_eos=True)))
            while engine.has_work():
                engine.step()
            return engine
        except ValueError as exc:
            if "attention backend" in str(exc):  # make_backend's refusal: nothing to fall back to
                raise _Unavailable(str(exc)) from exc
            out.setdefault("fallbacks", []).append(f"{variant.cuda_graphs}: {exc!r}"[:600])
        except Exception as exc:  # free what it holds (its KV), then try without graphs
            out.setdefault("fallbacks", []).append(f"{variant.cuda_graphs}: {exc!r}"[:600])
        engine = None
        w.free(torch.device(config.device))
    raise RuntimeError(f"no {config.attention_backend} engine could serve a request")


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
    attention choice for this device: the tower's own time (inputs staged before the timer, CUDA events on CUDA),
    and the staging apart."""
    from services.models.qwen2_vl_vision import time_tower, tower_takes_plan
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
    out["planned"] = tower_takes_plan(type(model.model.visual))
    adapter.encode(model, items)  # warm-up
    w.sync(device)
    started = time.perf_counter()
    call = adapter.staged_tower(model, items)
    w.sync(device)
    out["staging_ms"] = round((time.perf_counter() - started) * 1e3, 2)
    seconds = time_tower(call, device, 3)
    out["tower_ms"] = round(seconds * 1e3, 2)
    out["images_per_s"] = round(len(items) / seconds, 2)


def _round(value: float, digits: int) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


SECTIONS = {"env": env, "kernel": kernel, "exactness": exactness, "structured": structured, "decode": decode,
            "vision": vision, "tensor_parallel": tensor_parallel}  # fmt: skip
