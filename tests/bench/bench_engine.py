"""Benchmark: our engine against transformers' `generate` with static batches, one workload, same run.

    python -m tests.bench.bench_engine [--quick] [--model DIR] [--requests 64] ...

Mixed workload: text prompts, a share of them with a 448x448 image, 64 to 256 output tokens (eos
ignored, so both runs produce exactly the same number of tokens), Poisson arrivals. Images are encoded
in both runs on the same process (the engine encodes at arrival, as a co-located worker; `generate` runs
the vision tower inside each batch). Prints tokens/s, TTFT and inter-token latency p50/p99 for both, tokens per
CPU-second of each (`cpu_ratio`), the engine's decode step at `--max-num-seqs` sequences against the bare forward
of the same batch (tests/bench/step_overhead.py: `overhead_ratio`, `overhead_cpu_ratio`), then one JSON line with
`tokens_per_s`, `baseline_tokens_per_s`, `ratio` and those.

With `--structured` the engine runs the workload without a constraint and with a JSON-schema constraint on
every request (`STRUCTURED_SCHEMA`: at least 64 objects of a name and a flag, so every request still makes
exactly its tokens), alternating, `--repeats` times each, and prints both, then one JSON line with
`structured_tokens_per_s`, `tokens_per_s` and `structured_ratio` (constrained / unconstrained, wall clock),
and the same ratio per CPU-second of the engine thread (`structured_thread_cpu_ratio`: what gates a step when
a core is free for the grammar thread) and of the whole process (`structured_cpu_ratio`: the grammar thread's
work counted too), with the load average: on a box busy with other work the wall clock counts waits for a core.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from services.common.grammar import Constraint
from services.models.media_span import MediaSpan
from services.models.registry import load_adapter
from services.worker.engine.config import ATTENTION_BACKENDS, EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.bench.hf_baseline import run_static_batches
from tests.bench.step_overhead import measure_step_overhead
from tests.bench.workload import BenchRequest, Summary, Timeline, make_workload, summarize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epd bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: a tiny random Qwen2-VL built offline)")
    parser.add_argument("--quick", action="store_true", help="a small workload, for a smoke run")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--image-fraction", type=float, default=0.5)
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument(
        "--mean-interval-ms",
        type=float,
        default=5.0,
        help="mean gap between arrivals (small enough that both runs outlast the arrivals: a throughput figure)",
    )
    parser.add_argument("--baseline-batch", type=int, default=16, help="static batch size for generate")
    served = EngineConfig()  # the engine's own defaults, as a worker serves with them
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=served.max_num_batched_tokens,
        help="engine token budget per step (decodes + prefill)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=served.max_num_seqs, help="engine sequence cap")
    parser.add_argument(
        "--prefill-tokens-per-free-seq",
        type=int,
        default=served.prefill_tokens_per_free_seq,
        help="decode priority: prefill tokens a step may take per sequence slot not decoding (0: off)",
    )
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="engine decode attention (EngineConfig)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per op (0: torch's default)")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="run the vision tower inside both runs (default: embeddings computed beforehand for both)",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="the engine with and without a JSON-schema constraint on every request (instead of generate)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="instead of generate: the engine at this tensor-parallel size against TP=1, same run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians reported")
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=64,
        help="decode steps of max-num-seqs sequences timed against the bare forward of the same batch (0: none)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.min_output, args.max_output, args.repeats = min(args.requests, 16), 16, 48, 1
        args.overhead_steps = min(args.overhead_steps, 16)
    return args


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
                "required": ["name", "ok"],
            },
            "minItems": 64,
        }
    },
    "required": ["items"],
}
"""The ``--structured`` constraint: an extraction-shaped schema whose JSON cannot end before 640 tokens (each
item takes at least 10), so every request still makes exactly its tokens."""


def run_engine(
    adapter: Any,
    model: Any,
    requests: list[BenchRequest],
    config: EngineConfig,
    colocated: bool,
    constraint: Constraint | None = None,
) -> list[Timeline]:
    """Feed requests at their arrival times and step until all finish.

    A request's image embedding arrives with it (computed beforehand, as the encoder service pushes it),
    or, ``colocated``, is computed on the engine thread at arrival. With ``constraint`` every request has it;
    it is compiled before the clock starts (a served constraint comes from the worker's cache).
    """
    engine = Engine(adapter, model, config)
    if constraint is not None:
        engine.structured.cache.compile(constraint).result()
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
            submit(adapter, model, engine, arrived, colocated, constraint)
        if not engine.has_work():
            time.sleep(max(pending[0].arrival_s - (time.perf_counter() - start), 0.0) if pending else 0.0)
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            timelines[out.request_id].token_times.extend([stamp] * len(out.new_token_ids))
            finished += out.finished
    return [timelines[r.request_id] for r in requests]


def submit(
    adapter: Any,
    model: Any,
    engine: Engine,
    arrived: list[BenchRequest],
    colocated: bool,
    constraint: Constraint | None = None,
) -> None:
    with_image = [r for r in arrived if r.pixels is not None]
    if colocated and with_image:
        embeddings = adapter.encode(model, [r.pixels for r in with_image])
    else:
        embeddings = [r.embedding for r in with_image]
    for request, embedding in zip(with_image, embeddings, strict=True):
        engine.provide_embedding(request.request_id, embedding)
    for r in arrived:
        media = []
        if r.pixels is not None:
            media = [MediaSpan(r.request_id, r.image_offset, r.image_tokens, r.pixels.grid_thw)]
        sampling = SamplingOptions(max_tokens=r.max_tokens, ignore_eos=True, structured=constraint)
        engine.add_request(EngineRequest(r.request_id, r.token_ids, media, sampling))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        prefill_tokens_per_free_seq=args.prefill_tokens_per_free_seq,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
    )


def line(name: str, s: Summary) -> str:
    return (
        f"{name:<12} {s.tokens_per_s:8.1f} tok/s  TTFT p50 {s.ttft_p50_ms:7.1f} ms  p99 {s.ttft_p99_ms:7.1f} ms  "
        f"ITL p50 {s.itl_p50_ms:6.2f} ms  p99 {s.itl_p99_ms:6.2f} ms  ({s.output_tokens} tokens in {s.wall_s:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    """`epd bench engine`: run the comparison, print it; exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both, print the figures (the JSON summary last) and return that summary."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if model_dir is None:
            from services.models.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(scratch) / "tiny", "qwen2-vl")
        adapter = load_adapter(model_dir)
        dtype = EngineConfig(dtype=args.dtype).torch_dtype
        engine_model = adapter.load_model(args.device, dtype)
        baseline_model = adapter.load_model(args.device, dtype)  # keeps transformers' own attention
        interval = args.mean_interval_ms / 1000
        output_range = (args.min_output, args.max_output)
        requests = make_workload(adapter, args.requests, args.image_fraction, output_range, interval, args.seed)
        warmup = make_workload(adapter, 4, 0.5, (4, 8), 0.0, args.seed + 1)
        encode_images(adapter, engine_model, requests + warmup)
        if args.structured:
            return run_structured(args, adapter, engine_model, requests, warmup)
        if args.tensor_parallel_size > 1:
            from tests.bench.bench_tensor_parallel import run_tensor_parallel

            return run_tensor_parallel(args, Path(model_dir), requests, warmup, engine_config(args))
        run_engine(adapter, engine_model, warmup, engine_config(args), args.colocated)
        run_static_batches(adapter, baseline_model, warmup, args.baseline_batch, args.colocated)
        # as the worker does after start-up (services/serve.py): what loading made lives as long as the
        # process, so collections need not walk it; without this a full collection pauses either run ~10 ms
        gc.collect()
        gc.freeze()
        ours, base, ours_cpu, base_cpu = [], [], [], []
        for _ in range(args.repeats):  # alternate, so a noisy neighbour hits both alike
            cpu = time.process_time()
            ours.append(summarize(run_engine(adapter, engine_model, requests, engine_config(args), args.colocated)))
            ours_cpu.append(ours[-1].output_tokens / (time.process_time() - cpu))
            cpu = time.process_time()
            base.append(
                summarize(run_static_batches(adapter, baseline_model, requests, args.baseline_batch, args.colocated))
            )
            base_cpu.append(base[-1].output_tokens / (time.process_time() - cpu))
        overhead = None
        if args.overhead_steps:
            overhead = measure_step_overhead(adapter, engine_model, requests, engine_config(args), args.overhead_steps)
    images = sum(r.pixels is not None for r in requests)
    encoder = "inside both runs" if args.colocated else "beforehand for both (as the encoder service does)"
    print(
        f"workload: {len(requests)} requests ({images} with a 448x448 image), outputs {output_range[0]}-"
        f"{output_range[1]} tokens, mean arrival gap {args.mean_interval_ms:.0f} ms (last arrival at "
        f"{requests[-1].arrival_s:.2f} s), torch threads "
        f"{torch.get_num_threads()}, vision tower run {encoder}"
        f"; engine budget {args.max_num_batched_tokens} tokens, {args.max_num_seqs} seqs, "
        f"{args.prefill_tokens_per_free_seq} prefill tokens per free seq; baseline static batches of "
        f"{args.baseline_batch}; {args.repeats} runs each, medians last"
    )
    for i, (a, b) in enumerate(zip(ours, base, strict=True)):
        print(line(f"engine #{i + 1}", a))
        print(line(f"generate #{i + 1}", b))
    ours_median, base_median = median_summary(ours), median_summary(base)
    print(line("engine", ours_median))
    print(line("generate", base_median))
    result = {
        **asdict(ours_median),
        **{f"baseline_{k}": v for k, v in asdict(base_median).items()},
        "ratio": ours_median.tokens_per_s / base_median.tokens_per_s,
        "requests": len(requests),
        "cpu_tokens_per_s": statistics.median(ours_cpu),
        "baseline_cpu_tokens_per_s": statistics.median(base_cpu),
    }
    result["cpu_ratio"] = result["cpu_tokens_per_s"] / result["baseline_cpu_tokens_per_s"]
    print(
        f"per CPU-second of this process: engine {result['cpu_tokens_per_s']:.1f} tokens, generate "
        f"{result['baseline_cpu_tokens_per_s']:.1f} (ratio {result['cpu_ratio']:.2f}; a busy neighbour does not "
        f"inflate CPU time as it does the wall clock)"
    )
    if overhead is not None:
        print(overhead.line())
        result.update(
            engine_step_ms=overhead.engine_step_ms,
            bare_forward_ms=overhead.bare_forward_ms,
            overhead_ratio=overhead.ratio,
            engine_step_cpu_ms=overhead.engine_step_cpu_ms,
            bare_forward_cpu_ms=overhead.bare_forward_cpu_ms,
            overhead_cpu_ratio=overhead.cpu_ratio,
            overhead_rows=overhead.rows,
        )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return result


def run_structured(
    args: argparse.Namespace, adapter: Any, model: Any, requests: list[BenchRequest], warmup: list[BenchRequest]
) -> dict[str, Any]:
    """``--structured``: the engine without and with ``STRUCTURED_SCHEMA`` on every request, alternating."""
    constraint = Constraint("json_schema", json.dumps(STRUCTURED_SCHEMA))
    config = engine_config(args)
    run_engine(adapter, model, warmup, config, args.colocated)
    run_engine(adapter, model, warmup, config, args.colocated, constraint)
    gc.collect()
    gc.freeze()
    plain, constrained = [], []
    cpu: dict[str, list[float]] = {"free_thread": [], "free_process": [], "schema_thread": [], "schema_process": []}
    for _ in range(args.repeats):
        for side, runs, given in (("free", plain, None), ("schema", constrained, constraint)):
            thread, process = time.thread_time(), time.process_time()
            runs.append(summarize(run_engine(adapter, model, requests, config, args.colocated, given)))
            cpu[f"{side}_thread"].append(runs[-1].output_tokens / (time.thread_time() - thread))
            cpu[f"{side}_process"].append(runs[-1].output_tokens / (time.process_time() - process))
    per_cpu = {key: statistics.median(values) for key, values in cpu.items()}
    print(
        f"workload: {len(requests)} requests, outputs {args.min_output}-{args.max_output} tokens; the same engine "
        f"without and with a JSON-schema constraint on every request; {args.repeats} runs each, medians last"
    )
    for i, (a, b) in enumerate(zip(plain, constrained, strict=True)):
        print(line(f"free #{i + 1}", a))
        print(line(f"schema #{i + 1}", b))
    free, schema = median_summary(plain), median_summary(constrained)
    print(line("free", free))
    print(line("schema", schema))
    assert free.output_tokens == schema.output_tokens, "the constraint ended requests early"
    thread_ratio = per_cpu["schema_thread"] / per_cpu["free_thread"]
    cpu_ratio = per_cpu["schema_process"] / per_cpu["free_process"]
    load = os.getloadavg()
    print(
        f"tokens per CPU-second, free -> schema: engine thread {per_cpu['free_thread']:.1f} -> "
        f"{per_cpu['schema_thread']:.1f} (ratio {thread_ratio:.3f}), process {per_cpu['free_process']:.1f} -> "
        f"{per_cpu['schema_process']:.1f} (ratio {cpu_ratio:.3f}); wall ratio "
        f"{schema.tokens_per_s / free.tokens_per_s:.3f}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    result = {
        **asdict(free),
        **{f"structured_{k}": v for k, v in asdict(schema).items()},
        "structured_ratio": schema.tokens_per_s / free.tokens_per_s,
        "structured_thread_cpu_ratio": thread_ratio,
        "structured_cpu_ratio": cpu_ratio,
        "requests": len(requests),
        "load_average": [round(x, 2) for x in load],
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return result


def encode_images(adapter: Any, model: Any, requests: list[BenchRequest]) -> None:
    """Every image's embedding, computed once before the timed runs."""
    with_image = [r for r in requests if r.pixels is not None]
    for request, embedding in zip(with_image, adapter.encode(model, [r.pixels for r in with_image]), strict=True):
        request.embedding = embedding


def median_summary(runs: list[Summary]) -> Summary:
    """Each figure's median over the runs."""
    fields = asdict(runs[0])
    values = {k: statistics.median(asdict(r)[k] for r in runs) for k in fields}
    return Summary(**{k: type(fields[k])(v) for k, v in values.items()})


if __name__ == "__main__":
    raise SystemExit(main())
