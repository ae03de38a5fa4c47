"""The GPU check: what a borrowed GPU machine runs as it is (`tests/gpu/run.sh`), printing one JSON line.

Models are built in memory from configs with random weights (no downloads, no tokenizer): prompts are token
ids, images are random pixel patches. Sections, each reported even when another fails:

- ``env``: torch / transformers versions, the device, whether torch's ``varlen_attn`` takes a ``block_table``.
- ``kernel``: the FlashAttention call against its pure-torch twin on a random paged pool (bf16, CUDA only).
- ``exactness``: 16 concurrent mixed requests (text, 1-3 images) on a small Qwen2-VL in fp32 through the
  engine (``auto`` backend, decode graphs where they apply) against ``generate`` alone, ties aside.
- ``decode``: bf16 decode throughput and inter-token latency of the engine against ``generate`` with static
  batches at 1, 32 and 128 sequences on a Qwen2-VL-7B-shaped language model; the engine's decode step
  against the bare forward replayed from its CUDA graph (the overhead ratio); the KV blocks from memory.
- ``vision``: vision-tower images/s for 1344x1008 images on the 7B's vision config.

``--dry-run`` runs the same code on the CPU with tiny shapes (CI runs it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.models.base import PixelInputs
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.tiny_model import tiny_config
from services.models.tiny_tokenizer import TinyTokenizerInfo
from services.models.varlen_attention import flash_supports, torch_varlen_attn, varlen_attn_reference
from services.models.vision_attention import install_vision_attention
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, MediaInput, SamplingOptions

SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
TINY_VOCAB = 1024


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    args = parser.parse_args()
    plan = DRY if args.dry_run else GPU
    torch.manual_seed(0)
    report: dict[str, Any] = {"dry_run": args.dry_run}
    started = time.perf_counter()
    for name, section in (("env", env), ("kernel", kernel), ("exactness", exactness), ("decode", decode),
                          ("vision", vision)):  # fmt: skip
        report[name] = _guarded(section, plan)
        _free(torch.device(plan.device))
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, sort_keys=True), flush=True)


def _guarded(section: Callable[[Plan], dict[str, Any]], plan: Plan) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        out = section(plan)
    except Exception as exc:  # one failing section must not hide the others' figures
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=6)[-1500:]}
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


# ----- sections -----


def env(plan: Plan) -> dict[str, Any]:
    import transformers

    device = torch.device(plan.device)
    out: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "cuda": torch.version.cuda, "device": plan.device}  # fmt: skip
    out["varlen_attn_block_table"] = torch_varlen_attn() is not None
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["flash_bf16"] = flash_supports(device, torch.bfloat16)
    return out


def kernel(plan: Plan) -> dict[str, Any]:
    """torch's varlen_attn (when it runs here) against the reference on one random paged pool of 256-token pages."""
    device = torch.device(plan.device)
    if not flash_supports(device, torch.bfloat16):
        return {"skipped": "no paged FlashAttention here (CPU, or torch without varlen_attn block_table)"}
    pages, page, kv_heads, heads, dim = 64, 256, 4, 28, 128
    key = torch.randn(pages, page, kv_heads, dim, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    q_lens, ctx = [1, 1, 7, 300, 1], [900, 256, 513, 300, 1]
    table = torch.randperm(pages, device=device, dtype=torch.int32)[: 5 * 4].view(5, 4).contiguous()
    query = torch.randn(sum(q_lens), heads, dim, device=device, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *_cumsum(ctx)], dtype=torch.int32, device=device)
    used = torch.tensor(ctx, dtype=torch.int32, device=device)
    args = (query, key, value, cu_q, cu_k, max(q_lens), max(ctx))
    kwargs = {"window_size": (-1, 0), "enable_gqa": True, "seqused_k": used, "block_table": table}
    fast = torch_varlen_attn()(*args, **kwargs)
    slow = varlen_attn_reference(*args, **kwargs)
    return {"max_abs_diff_bf16": float((fast.float() - slow.float()).abs().max())}


def exactness(plan: Plan) -> dict[str, Any]:
    """Greedy tokens of 16 concurrent mixed requests through the engine against ``generate`` for each alone."""
    device = torch.device(plan.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, adapter = _tiny_model(device, torch.float32, width=64, layers=2)
    gen = torch.Generator().manual_seed(1)
    prompts = [_mixed_prompt(adapter, model, i, gen) for i in range(16)]
    references = [_generate(model, p, 12) for p in prompts]
    on_gpu = device.type == "cuda"  # on the CPU, mirror what auto picks for fp32 on CUDA
    config = EngineConfig(device=plan.device, max_num_batched_tokens=64, max_num_seqs=16, kv_cache_bytes=64 << 20,
                          max_model_len=2048, attention_backend="auto" if on_gpu else "flash-reference",
                          cuda_graphs="auto" if on_gpu else "eager")  # fmt: skip
    engine = Engine(adapter, model, config)
    tokens = _run_engine(engine, prompts, 12, stagger=True)
    exact, ties, wrong = 0, 0, []
    for i, (got, ref) in enumerate(zip(tokens, references, strict=True)):
        if got == ref.tokens:
            exact += 1
        elif _diverges_at_tie(got, ref):
            ties += 1
        else:
            wrong.append(i)
    return {"requests": 16, "exact": exact, "ties": ties, "wrong": wrong, "backend": engine.config.attention_backend,
            "block_size": engine.config.block_size, "graphs": engine.config.cuda_graphs,
            "graph_steps": engine.runner.graphs.steps if engine.runner.graphs else 0}  # fmt: skip


def decode(plan: Plan) -> dict[str, Any]:
    """bf16 decode: the engine against generate's static batches; the engine step against its bare graph replay."""
    device = torch.device(plan.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, adapter = _lm_model(plan, device, dtype)
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "prompt_tokens": plan.prompt_tokens,
                           "new_tokens": plan.new_tokens}  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    vocab = int(model.config.get_text_config().vocab_size)
    batches = {b: [torch.randint(0, vocab - 16, (plan.prompt_tokens,), generator=gen).tolist() for _ in range(b)]
               for b in plan.decode_batches}  # fmt: skip
    baseline = {b: _generate_timed(model, ids, plan.new_tokens) for b, ids in batches.items()}
    _free(device)
    on_gpu = device.type == "cuda"  # the CPU dry run takes the GPU's path: varlen call, 256-token blocks, graph steps
    base = EngineConfig(
        device=plan.device, dtype=dtype, max_num_seqs=max(plan.decode_batches), max_num_batched_tokens=4096,
        gpu_memory_utilization=0.85, kv_cache_bytes=0 if on_gpu else 64 << 20,
        attention_backend="auto" if on_gpu else "flash-reference", block_size=0 if on_gpu else 256,
        cuda_graphs="auto" if on_gpu else "eager", max_model_len=None if on_gpu else 1024,
    )  # fmt: skip
    engine = _working_engine(adapter, model, base, out)
    out.update(
        backend=engine.config.attention_backend,
        block_size=engine.config.block_size,
        kv_blocks=engine.runner.num_blocks,
        kv_bytes=engine.config.kv_cache_bytes,
        graphs=engine.config.cuda_graphs,
    )
    out["syncs_per_step"] = _syncs_per_step(engine, batches[max(batches)][:8], plan.new_tokens)
    for b, ids in batches.items():
        timed = _engine_timed(engine, ids, plan.new_tokens)
        bare = _bare_step_seconds(engine, b)
        hf = baseline[b]
        out[f"batch_{b}"] = {
            "engine_tok_s": round(timed.tokens_per_s, 1), "generate_tok_s": round(hf.tokens_per_s, 1),
            "throughput_ratio": round(timed.tokens_per_s / hf.tokens_per_s, 2),
            "engine_itl_ms": round(timed.itl_s * 1e3, 3), "generate_itl_ms": round(hf.itl_s * 1e3, 3),
            "engine_itl_p99_ms": round(timed.itl_p99_s * 1e3, 3),
            "bare_step_ms": round(bare * 1e3, 3), "overhead_ratio": round(timed.itl_s / bare, 3),
        }  # fmt: skip
    return out


def _working_engine(adapter: Any, model: Any, config: EngineConfig, out: dict[str, Any]) -> Engine:
    """An engine with ``config`` that serves a request; failing that (recorded in ``out["fallbacks"]``) the same
    without decode graphs, then with the flash-reference backend: one run reports as much as it can."""
    variants = [
        config,
        dataclasses.replace(config, cuda_graphs="off"),
        dataclasses.replace(config, cuda_graphs="off", attention_backend="flash-reference", block_size=256),
    ]
    for variant in variants:
        try:
            engine = Engine(adapter, model, variant)
            engine.add_request(EngineRequest("smoke", [1, 2, 3, 4], [], SamplingOptions(max_tokens=3, ignore_eos=True)))
            while engine.has_work():
                engine.step()
            return engine
        except Exception as exc:  # keep going with a plainer engine, and say why
            out.setdefault("fallbacks", []).append(f"{variant.attention_backend}/{variant.cuda_graphs}: {exc!r}"[:600])
    raise RuntimeError("no engine variant could serve a request")


def _syncs_per_step(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Host synchronisations CUDA reports per engine step (``set_sync_debug_mode``): one is the sampled ids."""
    if engine.runner.device.type != "cuda":
        return {"skipped": "CUDA only (the CPU test counts host reads instead: tests/unit/test_host_sync.py)"}
    import warnings

    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"sync-{i}", ids, [], SamplingOptions(max_tokens=new_tokens, ignore_eos=True)))
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_work():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"steps": len(counts), "max": max(counts), "mean": round(sum(counts) / len(counts), 2)}


def vision(plan: Plan) -> dict[str, Any]:
    """Images/s of the vision tower and projector, ``images_per_call`` images per forward."""
    device = torch.device(plan.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if plan.vision_7b:
        model, adapter = _seven_b(device, dtype, text_layers=1)
    else:
        model, adapter = _tiny_model(device, dtype, width=64, layers=1)
    attention = install_vision_attention(model, "auto")  # what an encoder on this device runs
    width, height = plan.image_size
    grid = (1, height // 14 // 2 * 2, width // 14 // 2 * 2)
    patch = 3 * 2 * 14 * 14
    items = [PixelInputs(torch.randn(grid[1] * grid[2], patch), grid) for _ in range(plan.images_per_call)]
    adapter.encode(model, items)  # warm-up
    _sync(device)
    calls = 3
    started = time.perf_counter()
    for _ in range(calls):
        adapter.encode(model, items)
    _sync(device)
    seconds = time.perf_counter() - started
    return {"image": f"{width}x{height}", "grid_thw": list(grid), "tokens_per_image": grid[1] * grid[2] // 4,
            "images_per_s": round(calls * len(items) / seconds, 2),
            "attention": attention, "implementation": model.config.vision_config._attn_implementation}  # fmt: skip


# ----- models and prompts -----


def _tiny_model(device: torch.device, dtype: torch.dtype, width: int, layers: int) -> tuple[Any, Qwen2VLAdapter]:
    info = TinyTokenizerInfo(TINY_VOCAB, {name: TINY_VOCAB - len(SPECIAL) + i for i, name in enumerate(SPECIAL)})
    return _build(tiny_config("qwen2-vl", info, width, layers), device, dtype)


def _lm_model(plan: Plan, device: torch.device, dtype: torch.dtype) -> tuple[Any, Qwen2VLAdapter]:
    if plan.lm_width is None:
        return _seven_b(device, dtype, text_layers=None)
    return _tiny_model(device, dtype, width=plan.lm_width, layers=4)


def _seven_b(device: torch.device, dtype: torch.dtype, text_layers: int | None) -> tuple[Any, Qwen2VLAdapter]:
    from services.models.shapes import qwen2_vl_7b_config

    config = qwen2_vl_7b_config() if text_layers is None else qwen2_vl_7b_config(text_layers=text_layers)
    return _build(config, device, dtype)


def _build(config: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, Qwen2VLAdapter]:
    import transformers

    from services.models.shapes import random_model

    if isinstance(config, dict):
        config = transformers.AutoConfig.for_model(**config)
    model = random_model(config, device, dtype)
    return model, Qwen2VLAdapter.from_config(model.config)


@dataclass(frozen=True)
class _Prompt:
    token_ids: list[int]
    media: list[MediaInput]
    pixels: list[PixelInputs]
    embeddings: list[torch.Tensor]


def _mixed_prompt(adapter: Qwen2VLAdapter, model: Any, index: int, gen: torch.Generator) -> _Prompt:
    """Text around 0-3 random images (prompt ``index`` % 4 images), token ids below the special ones."""
    config = model.config
    ids = _random_ids(gen, 5 + index % 7)
    media, pixels = [], []
    for image in range(index % 4):
        h, w = 2 * (2 + (index + image) % 4), 2 * (2 + (index * 3 + image) % 5)
        grid = (1, h, w)
        ids.append(config.vision_start_token_id)
        media.append(MediaInput(f"img-{index}-{image}", len(ids), h * w // 4, grid))
        ids.extend([config.image_token_id] * (h * w // 4))
        ids.append(config.vision_end_token_id)
        ids.extend(_random_ids(gen, 1 + image))
        pixels.append(PixelInputs(torch.randn(h * w, 3 * 2 * 14 * 14, generator=gen), grid))
    embeddings = adapter.encode(model, pixels) if pixels else []
    return _Prompt(ids, media, pixels, [e.detach() for e in embeddings])


def _random_ids(gen: torch.Generator, count: int) -> list[int]:
    return torch.randint(0, TINY_VOCAB - len(SPECIAL), (count,), generator=gen).tolist()


@dataclass(frozen=True)
class _Reference:
    tokens: list[int]
    scores: list[torch.Tensor]  # logits of each generated step


def _generate(model: Any, prompt: _Prompt, max_tokens: int) -> _Reference:
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt.token_ids], device=device)
    extra: dict[str, Any] = {"attention_mask": torch.ones_like(input_ids)}
    if prompt.pixels:
        extra["pixel_values"] = torch.cat([p.pixel_values for p in prompt.pixels]).to(device)
        extra["image_grid_thw"] = torch.tensor([p.grid_thw for p in prompt.pixels], device=device)
    extra["mm_token_type_ids"] = (input_ids == model.config.image_token_id).to(torch.int32)
    with torch.no_grad():
        try:
            out = model.generate(input_ids=input_ids, max_new_tokens=max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, **extra)  # fmt: skip
        except (TypeError, ValueError) as exc:  # an older transformers without mm_token_type_ids
            if "mm_token_type_ids" not in str(exc):
                raise
            extra.pop("mm_token_type_ids")
            out = model.generate(input_ids=input_ids, max_new_tokens=max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, **extra)  # fmt: skip
    return _Reference(out.sequences[0, input_ids.shape[1] :].tolist(), [s[0].float().cpu() for s in out.scores])


def _diverges_at_tie(got: list[int], ref: _Reference) -> bool:
    """Whether the first difference is where generate's top two logits are within 1e-4 (a tie)."""
    for step, (a, b) in enumerate(zip(got, ref.tokens, strict=False)):
        if a != b:
            top = torch.topk(ref.scores[step], 2).values
            return float(top[0] - top[1]) < 1e-4
    return False


def _run_engine(engine: Engine, prompts: list[_Prompt], max_tokens: int, stagger: bool) -> list[list[int]]:
    results: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        for item, tensor in zip(prompt.media, prompt.embeddings, strict=True):
            engine.provide_embedding(item.mm_hash, tensor)
        engine.add_request(
            EngineRequest(f"r{i}", prompt.token_ids, prompt.media, SamplingOptions(max_tokens=max_tokens))
        )
        if stagger and i % 4 == 3:
            _collect(engine.step(), results)
    while engine.has_work():
        _collect(engine.step(), results)
    return [results.get(f"r{i}", []) for i in range(len(prompts))]


def _collect(outputs: list[Any], results: dict[str, list[int]]) -> None:
    for out in outputs:
        results.setdefault(out.request_id, []).extend(out.new_token_ids)


# ----- timing -----


@dataclass(frozen=True)
class _Timed:
    tokens_per_s: float
    itl_s: float
    itl_p99_s: float


def _generate_timed(model: Any, prompts: list[list[int]], new_tokens: int) -> _Timed:
    """``generate`` on a static batch: decode latency from a 1-token run and a ``new_tokens`` run."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}

    def run(count: int) -> float:
        _sync(device)
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=count, min_new_tokens=count, **kwargs)
        _sync(device)
        return time.perf_counter() - started

    run(2)  # warm-up
    first = run(1)
    total = run(new_tokens)
    itl = (total - first) / (new_tokens - 1)
    return _Timed(len(prompts) * new_tokens / total, itl, itl)


def _engine_timed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> _Timed:
    """All prompts at once; the time of each step in which every request decodes is one inter-token latency."""
    sampling = SamplingOptions(max_tokens=new_tokens, ignore_eos=True)
    _sync(engine.runner.device)
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"t{len(prompts)}-{i}", ids, [], sampling))
    decode_steps: list[float] = []
    running = engine.scheduler.running
    while engine.has_work():
        all_decoding = len(running) == len(prompts) and all(s.num_tokens - s.num_computed_tokens == 1 for s in running)
        step_start = time.perf_counter()
        engine.step()  # ends with the step's one device-to-host copy: the step is done on the device too
        if all_decoding:
            decode_steps.append(time.perf_counter() - step_start)
    total = time.perf_counter() - started
    decode_steps.sort()
    p99 = decode_steps[min(len(decode_steps) - 1, int(0.99 * len(decode_steps)))]
    return _Timed(len(prompts) * new_tokens / total, statistics.median(decode_steps), p99)


def _bare_step_seconds(engine: Engine, batch: int) -> float:
    """The decode forward alone at ``batch`` rows: its CUDA graph replayed back to back (on the CPU, the same
    padded step run eagerly)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return float("nan")
    bucket = graphs.buckets[[b >= batch for b in graphs.buckets].index(True)]
    step = graphs.dummy_step(bucket)
    repeats = 20
    device = engine.runner.device
    with torch.inference_mode():
        graphs.run(step)
        _sync(device)
        started = time.perf_counter()
        for _ in range(repeats):
            graphs.rerun(step)
        _sync(device)
    return (time.perf_counter() - started) / repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


if __name__ == "__main__":
    main()
