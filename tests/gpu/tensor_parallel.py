"""The GPU check's ``tensor_parallel`` section: a TP=2 engine (NCCL over two GPUs, bf16) against TP=1 on the same
random model folder: greedy tokens of 32 text requests (agreeing except where TP=1's top two logits tie), the
median decode step at 32 sequences of each, and the start-up time; skipped with a reason on fewer than 2 GPUs.
The dry run (CPU, gloo, fp32, tiny) expects every token equal."""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.models.registry import load_adapter
from services.models.tiny_model import make_tiny_model
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions

GPU_SHAPE = {"width": 512, "layers": 8, "requests": 32, "prompt": 128, "new": 64, "dtype": "bfloat16", "tie": 0.05}
DRY_SHAPE = {"width": 64, "layers": 2, "requests": 8, "prompt": 24, "new": 8, "dtype": "float32", "tie": 1e-4}
"""The GPU run: 4 query heads of 128 over 2 KV heads (one per rank), 8 layers; ``tie`` is the top-two logit gap
counted as a tie (bf16 logits near 8 step by 0.03)."""


def tensor_parallel(plan: Any, out: dict[str, Any]) -> None:
    on_gpu = plan.device == "cuda"
    count = torch.cuda.device_count() if on_gpu else 0
    if on_gpu and count < 2:
        out["skipped"] = f"tensor parallelism needs 2 or more GPUs; this machine has {count}"
        return
    try:
        import PIL  # noqa: F401
    except ImportError:  # a rank loads the folder as a worker does, image processor included
        out["skipped"] = "tensor-parallel ranks load the model folder; its image processor needs Pillow, not installed"
        return
    shape = GPU_SHAPE if on_gpu else DRY_SHAPE
    out["devices"] = count if on_gpu else "cpu (gloo)"
    with tempfile.TemporaryDirectory() as scratch:
        folder = make_tiny_model(
            Path(scratch) / "tp", "qwen2-vl", text_width=shape["width"], text_layers=shape["layers"]
        )
        gen = torch.Generator().manual_seed(3)
        limit = 500  # the tiny tokenizer's plain ids sit below its special and media tokens
        prompts = [
            torch.randint(0, limit, (shape["prompt"] + i,), generator=gen).tolist() for i in range(shape["requests"])
        ]
        runs: dict[int, dict[str, Any]] = {}
        reference_model = None
        for size in (1, 2):
            adapter = load_adapter(folder)
            model = adapter.load_model(plan.device if size == 1 else "cpu", getattr(torch, shape["dtype"]))  # TP: moved
            config = EngineConfig(device=plan.device, dtype=shape["dtype"], tensor_parallel_size=size,
                                  max_num_seqs=shape["requests"], max_num_batched_tokens=2048, max_model_len=1024,
                                  kv_cache_bytes=0 if on_gpu else 16 << 20)  # fmt: skip
            started = time.perf_counter()
            engine = Engine(adapter, model, config)
            runs[size] = {"start_s": round(time.perf_counter() - started, 1)} | _decode(engine, prompts, shape["new"])
            runs[size]["backend"] = engine.config.attention_backend
            runs[size]["graphs"] = engine.config.cuda_graphs
            runs[size]["kv_blocks"] = engine.kv_state().total_blocks
            if size == 1:
                reference_model = model
            else:
                engine.runner.close()
            engine = None
            gc.collect()
            if on_gpu:  # the next engine sizes its KV from what is free
                torch.cuda.empty_cache()
        tokens = {size: runs[size].pop("tokens") for size in runs}
        out["tp1"], out["tp2"] = runs[1], runs[2]
        out["step_ratio"] = round(runs[2]["step_ms"] / runs[1]["step_ms"], 3)
        out.update(_agreement(reference_model, prompts, tokens[1], tokens[2], shape["tie"]))


def _decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All prompts at once, greedy: each request's tokens and the median step in which every request decodes."""
    results: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"tp{i}", ids, [], SamplingOptions(max_tokens=new_tokens, ignore_eos=True)))
    steps = []
    running = engine.scheduler.running
    while engine.has_work():
        decoding = len(running) == len(prompts) and all(s.num_tokens - s.num_computed_tokens == 1 for s in running)
        started = time.perf_counter()
        for output in engine.step():  # ends with the step's one device-to-host copy
            results.setdefault(output.request_id, []).extend(output.new_token_ids)
        if decoding:
            steps.append(time.perf_counter() - started)
    return {
        "tokens": [results[f"tp{i}"] for i in range(len(prompts))],
        "step_ms": round(1000 * statistics.median(steps), 3),
        "decode_steps": len(steps),
    }


def _agreement(model: Any, prompts: list[list[int]], one: list[list[int]], two: list[list[int]], tie: float) -> dict:
    """Requests whose TP=2 tokens equal TP=1's; for the others, TP=1's top-two logit gap where they first differ
    (transformers' own forward of that prefix on the TP=1 model): within ``tie`` it is a tie."""
    equal, ties, wrong = 0, 0, []
    device = next(model.parameters()).device
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        if a == b:
            equal += 1
            continue
        step = next(k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        ids = torch.tensor([prompts[i] + a[:step]], device=device)
        with torch.no_grad():
            top = torch.topk(model(input_ids=ids).logits[0, -1].float(), 2).values
        gap = float(top[0] - top[1])
        if gap <= tie:
            ties += 1
        else:
            wrong.append({"request": i, "step": step, "gap": round(gap, 4)})
    return {"requests": len(one), "equal": equal, "ties": ties, "wrong": wrong}
