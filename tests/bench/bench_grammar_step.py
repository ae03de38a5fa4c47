"""Benchmark: the engine's decode step with and without a JSON-schema constraint on every row, in CPU time.

    epd bench grammar_step [--rows 32] [--steps 200] [--repeats 5]

The tiny Qwen2-VL (one torch thread) decodes `--rows` requests together; once all decode, `--steps` steps are
timed, alternately without a constraint and with `epd bench engine --structured`'s schema on every request
(compiled before the clock), `--repeats` times each. Per step it prints the engine thread's CPU time
(`time.thread_time`: what gates the step when another core is free for the grammar thread), the process's CPU
time (every thread: the grammar's work counted wherever it ran) and wall time, each as constrained / free, the
fills the grammar thread ran beside the forward against those the engine thread ran, and the load average.
CPU time is what a box busy with other work leaves comparable; the wall clock counts the waits for a core.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.common.grammar import Constraint
from services.models.registry import load_adapter
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.gpu.structured import SCHEMA


def timed_steps(adapter: Any, model: Any, rows: int, steps: int, constraint: Constraint | None) -> dict[str, Any]:
    """Milliseconds per step (engine thread CPU, process CPU, wall) over ``steps`` steps of ``rows`` decodes."""
    engine = Engine(
        adapter, model, EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=512, max_num_seqs=rows)
    )
    if constraint is not None:
        engine.structured.cache.compile(constraint).result()
    for i in range(rows):
        ids = adapter.tokenizer.encode(f"request {i} please answer in json")
        sampling = SamplingOptions(max_tokens=steps + 20, ignore_eos=True, structured=constraint)
        engine.add_request(EngineRequest(f"r{i}", ids, [], sampling))
    while engine.awaiting_grammar or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine._sequences()):
        engine.step()
    thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        outputs = engine.step()
        assert len(outputs) == rows and not any(o.finished for o in outputs), "a row ended early"
    figures = {
        "thread_ms": (time.thread_time() - thread) / steps * 1e3,
        "process_ms": (time.process_time() - process) / steps * 1e3,
        "wall_ms": (time.perf_counter() - wall) / steps * 1e3,
        "fills_beside": engine.structured.fills_beside,
        "fills_here": engine.structured.fills_here,
    }
    engine.structured.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    """`epd bench grammar_step`: time both, print the figures (one JSON line last); exit status 0."""
    parser = argparse.ArgumentParser(prog="epd bench grammar_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from services.models.tiny_model import make_tiny_model

    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    with tempfile.TemporaryDirectory() as scratch:
        adapter = load_adapter(make_tiny_model(Path(scratch) / "tiny", "qwen2-vl"))
        model = adapter.load_model("cpu", torch.float32)
        timed_steps(adapter, model, args.rows, 8, None)  # warm-up
        timed_steps(adapter, model, args.rows, 8, constraint)
        gc.collect()
        gc.freeze()
        runs: dict[str, list[dict[str, Any]]] = {"free": [], "schema": []}
        for _ in range(args.repeats):  # alternate, so a noisy neighbour hits both alike
            runs["free"].append(timed_steps(adapter, model, args.rows, args.steps, None))
            runs["schema"].append(timed_steps(adapter, model, args.rows, args.steps, constraint))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    free, schema = med["free"], med["schema"]
    load = os.getloadavg()
    print(f"{args.rows} decoding rows, {args.steps} steps, medians of {args.repeats}; ms per step, free -> schema")
    result: dict[str, Any] = {"rows": args.rows, "load_average": [round(x, 2) for x in load]}
    for key, name in (("thread_ms", "engine thread CPU"), ("process_ms", "process CPU"), ("wall_ms", "wall")):
        ratio = free[key] / schema[key]
        print(f"{name:<18} {free[key]:7.3f} -> {schema[key]:7.3f}  ratio {ratio:.3f}")
        result |= {
            f"free_{key}": round(free[key], 3),
            f"schema_{key}": round(schema[key], 3),
            f"{key}_ratio": round(ratio, 3),
        }
    beside = sum(r["fills_beside"] for r in runs["schema"])
    here = sum(r["fills_here"] for r in runs["schema"])
    print(f"fills beside the forward {beside}, on the engine thread {here}; load average {load[0]:.2f} {load[1]:.2f}")
    print(json.dumps(result | {"fills_beside": beside, "fills_here": here}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
