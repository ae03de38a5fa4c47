"""`epd bench engine --tensor-parallel-size N`: the engine at TP=N against TP=1 in the same run, one workload:
tokens/s, inter-token latency and the median step time of each, alternating, medians."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from services.models.registry import load_adapter
from services.worker.engine.engine import Engine
from tests.bench.workload import BenchRequest, Summary, Timeline, summarize


def run_tensor_parallel(
    args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest], warmup: list[BenchRequest], config: Any
) -> dict[str, Any]:
    """Both engines built once (TP=N spawns its ranks once), warmed up, then ``args.repeats`` runs of each."""
    from tests.bench.bench_engine import line, median_summary

    sizes = (1, args.tensor_parallel_size)
    engines = {}
    for size in sizes:
        adapter = load_adapter(model_dir)
        model = adapter.load_model("cpu", config.torch_dtype)  # each its own: TP cuts the model in place
        engines[size] = Engine(adapter, model, dataclasses.replace(config, tensor_parallel_size=size))
    try:
        for size in sizes:
            feed(engines[size], warmup)
        gc.collect()
        gc.freeze()
        runs: dict[int, list[tuple[Summary, float]]] = {size: [] for size in sizes}
        for _ in range(args.repeats):
            for size in sizes:
                runs[size].append(feed(engines[size], requests))
    finally:
        close = getattr(engines[sizes[1]].runner, "close", None)
        if close is not None:
            close()
    print(
        f"workload: {len(requests)} requests ({sum(r.pixels is not None for r in requests)} with an image), "
        f"the engine at TP=1 and TP={sizes[1]} (gloo/NCCL ranks), {args.repeats} runs each, alternating, medians last"
    )
    medians = {}
    for size in sizes:
        for i, (summary, step_ms) in enumerate(runs[size]):
            print(line(f"TP={size} #{i + 1}", summary) + f"  step p50 {step_ms:.2f} ms")
        medians[size] = (median_summary([s for s, _ in runs[size]]), statistics.median(m for _, m in runs[size]))
    for size in sizes:
        print(line(f"TP={size}", medians[size][0]) + f"  step p50 {medians[size][1]:.2f} ms")
    one, many = medians[sizes[0]], medians[sizes[1]]
    result = {
        **dataclasses.asdict(one[0]),
        "step_p50_ms": one[1],
        **{f"tp_{k}": v for k, v in dataclasses.asdict(many[0]).items()},
        "tp_step_p50_ms": many[1],
        "tensor_parallel_size": sizes[1],
        "tp_ratio": many[0].tokens_per_s / one[0].tokens_per_s,
        "tp_step_ratio": many[1] / one[1],
        "requests": len(requests),
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return result


def feed(engine: Engine, requests: list[BenchRequest]) -> tuple[Summary, float]:
    """Requests at their arrival times (embeddings with them), stepped until all finish: the summary and the
    median step time (ms)."""
    from tests.bench.bench_engine import submit

    steps: list[float] = []
    engine.on_step = lambda timing: steps.append(timing.seconds)
    timelines = {r.request_id: Timeline(r.arrival_s) for r in requests}
    pending = deque(requests)
    finished = 0
    start = time.perf_counter()
    while finished < len(requests):
        now = time.perf_counter() - start
        arrived = []
        while pending and pending[0].arrival_s <= now:
            arrived.append(pending.popleft())
        if arrived:
            submit(engine.adapter, None, engine, arrived, False)
        if not engine.has_work():
            time.sleep(max(pending[0].arrival_s - (time.perf_counter() - start), 0.0) if pending else 0.0)
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            timelines[out.request_id].token_times.extend([stamp] * len(out.new_token_ids))
            finished += out.finished
    engine.on_step = None
    return summarize([timelines[r.request_id] for r in requests]), 1000 * statistics.median(steps)
