"""Benchmark: text streams decoding through a burst of large images, without and with an inter-token latency target.

Two real clusters (router, encoder, worker on free ports; a database each of one private Redis, so each
router sees only its own worker) in one invocation: one without a target, one with `EPD_ITL_TARGET_MS`
(`--itl-target-ms`, default `--target-factor` (2) x the quiet inter-token p99 of the first cluster's first two
episodes: the calibration; the JSON's `target_over_quiet_p99` is the factor the target run saw). Each cluster
first sends the images once with a `cache_salt` of their own (their embeddings are then cached: the bursts
measure the worker's prefill, not the encoder); then `--bursts` episodes each, alternating between the clusters
(no target, target, no target, ...: both see the shared box in the same minutes), each with a salt of its own
(its prompts miss the prefix cache): `--streams` text streams start (eos ignored, `--stream-tokens` each), and
once every stream has `--quiet-tokens` tokens, `--images` distinct images (`--image-size`) arrive at once with
`--image-tokens` tokens to generate.

What is measured, at the clients (the streams in one asyncio process, a channel each; the images from a process
of their own, as other users' requests: `ImageSender`): each token's arrival time. The
worker sends a step's tokens as they are sampled, one message per request, coalescing only tokens made while
its event loop was behind (then a k-token message is one gap and k - 1 zero gaps, what a user sees; the count
of such messages is printed). The quiet gaps are the stream tokens' from a fifth of `--quiet-tokens` to the
burst, pooled over the episodes; an episode's burst window runs from the images' send to the last image's
first token (all prefill done), and a gap is in it when it overlaps it. Printed per run: quiet ITL p50/p99/max
and the quiet typical worst gap (the statistic below over each episode's quiet gaps, ~160 a stream against the
window's ~300-400: what a run without any burst reads, its ratio to the quiet p99 the floor of the stall ratio),
burst ITL p50/p99/max, each stream's worst stall per episode, the typical worst stall (per episode the
median over streams, then the median over episodes), the joined ITL p50/p99 (the streams' gaps after the window
while the images still decode: every row decoding, no prefill left anywhere, so the floor that a split's decode
steps alone leave), image TTFT p50/max, and total tokens/s: every output
token that arrived after a burst's send over the time to the episode's last one, summed over episodes (the
same work in both runs: the streams' remaining tokens and the images). Last line, JSON: `stall_ratio` per run
(typical worst stall over the run's quiet p99), `throughput_ratio` (tokens/s over the no-target run's), and
each run's figures.

The model is make_tiny_model's, 256 wide and 4 layers deep by default: a decode step of 8 sequences costs
~3 ms on one core and a prefill token ~0.1 ms, so a 2048-token step stalls every stream for ~0.2 s. Every
service gets one torch thread and the priorities `epd up` gives (`--engine-process` runs both workers' engines in
a process of their own, docs/engine.md; `--compute-nice` sets `EPD_COMPUTE_NICE` for every service, where each
otherwise keeps its own default: the encoder's compute at nice 10, the worker's engine at 0; at 10 for the
worker, as `epd bench admission` runs, another program's load on this shared box took the engine thread's core
for up to 100 ms in a step planned at 20). The images are JPEGs (~0.2 MB each; a
PNG of the same noise is 2.7 MB, and eight at once kept the client and the router busy). The load average
at the end of each run is printed: figures taken while other programs load the box stall in the relay too.
It takes about two minutes.

`--pd` compares prefill/decode disaggregation instead: a co-located cluster (router, encoder, worker) against a
P/D one (router, encoder, a decode worker and a prefill worker, `--pd-min-prefill-tokens`, default 256: the
images go to the prefill worker, the short stream prompts prefill where they decode), neither with a target,
their episodes alternating. Each worker that decodes runs alone on the first core and everything else (router,
encoder, prefill worker, this process and its image sender) on the others (`os.sched_setaffinity` on every
thread of those processes, set again before each episode): each pool on a device of its own, as on a GPU
cluster. `--itl-target-ms` gives both clusters that target (default none). Printed as above per run, then
`pd_stall_over_quiet_p99` (the P/D run's typical worst stall over its quiet p99; the goal is at most 1.5),
`ttft_cost` (the P/D run's image TTFT p50 over the co-located one's) and the remote prefills the P/D router
counted. `--kv-transport grpc,dist` runs one P/D cluster per KV transport named (`EPD_KV_TRANSPORT` of its
workers; default `grpc`), all their episodes alternating with the co-located one's, each printed and in the
JSON line (`pd_runs`, `stall_ratio`), the first also as `pd_run`.
Run: `epd bench burst [--quick] [--itl-target-ms MS]`, `epd bench burst --pd [--quick] [--kv-transport grpc,dist]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from services.common.config import TRANSPORTS
from tests.bench.burst_clusters import BenchCluster, metric
from tests.bench.burst_figures import CALIBRATION_EPISODES, RunResult, Settings, print_run, summarize


async def run_both(
    model: Path,
    redis_url: str,
    settings: Settings,
    images: list[bytes],
    target_ms: float,
    factor: float,
    env: dict[str, str],
) -> tuple[RunResult, RunResult, float]:
    """The no-target cluster's first ``CALIBRATION_EPISODES`` episodes calibrate the target (unless given); then
    both clusters are up and their episodes alternate, so both see the box in the same minutes; ``env`` holds the
    settings both share. Returns both runs and the target.

    ``redis_url`` names database 0; the clusters take databases 0 and 1 of that server: each its own registry
    (a router sees only its own worker) and embedding cache."""
    base = redis_url.rsplit("/", 1)[0]
    plain = await BenchCluster.open(model, f"{base}/0", settings, images, 0.0, env)
    try:
        first = min(CALIBRATION_EPISODES, settings.bursts)
        for k in range(first):
            await plain.episode(f"plain-{k}")
        if not target_ms:
            target_ms = round(factor * summarize(plain.result, settings)["quiet_itl_p99_ms"], 1)
        targeted = await BenchCluster.open(model, f"{base}/1", settings, images, target_ms, env)
        try:
            for k in range(settings.bursts):
                await targeted.episode(f"target-{k}")
                if first + k < settings.bursts:
                    await plain.episode(f"plain-{first + k}")
        finally:
            await targeted.close()
    finally:
        await plain.close()
    return plain.result, targeted.result, target_ms


async def run_pd(
    model: Path,
    redis_url: str,
    settings: Settings,
    images: list[bytes],
    threshold: int,
    env: dict[str, str],
    target_ms: float = 0.0,
    kv_transports: tuple[str, ...] = ("grpc",),
) -> tuple[RunResult, dict[str, RunResult]]:
    """The co-located cluster and one P/D cluster per KV transport in ``kv_transports``, all pinned (`pin_pools`),
    all with ``target_ms`` (0: none), their episodes alternating (co-located first); databases 0, 1, ... of
    ``redis_url``'s server as in `run_both`. Returns the co-located run and the P/D runs by transport."""
    base = redis_url.rsplit("/", 1)[0]
    colocated = await BenchCluster.open(model, f"{base}/0", settings, images, target_ms, env, pinned=True)
    splits: dict[str, BenchCluster] = {}
    try:
        for db, transport in enumerate(kv_transports, start=1):
            splits[transport] = await BenchCluster.open(
                model, f"{base}/{db}", settings, images, target_ms, {**env, "EPD_KV_TRANSPORT": transport},
                prefill_workers=1, pd_min_prefill_tokens=threshold, pinned=True,
            )  # fmt: skip
        for k in range(settings.bursts):
            await colocated.episode(f"colocated-{k}")
            for transport, split in splits.items():
                await split.episode(f"pd-{transport}-{k}")
    finally:
        for split in splits.values():
            await split.close()
        await colocated.close()
    return colocated.result, {transport: split.result for transport, split in splits.items()}


def _pd_report(
    colocated: RunResult, splits: dict[str, RunResult], settings: Settings, threshold: int, target_ms: float
) -> dict:
    """The figures of every run and the P/D comparison, as printed and in the JSON line (the first P/D run's
    figures also under the keys a single P/D run has)."""
    local = summarize(colocated, settings)
    print_run("co-located", local)
    runs = {}
    for transport, split in splits.items():
        runs[transport] = pd = summarize(split, settings)
        print_run(f"P/D ({transport})", pd)
        pd["remote_prefills"] = split.remote_prefills
        pd["ttft_cost"] = pd["image_ttft_p50_ms"] / local["image_ttft_p50_ms"]
    first = next(iter(runs))
    pd = runs[first]
    report = {
        "pd": True,
        "pd_min_prefill_tokens": threshold,
        "itl_target_ms": target_ms,
        "kv_transports": list(runs),
        "stall_ratio": {"colocated": local["stall_ratio"], "pd": pd["stall_ratio"]}
        | {f"pd_{transport}": figures["stall_ratio"] for transport, figures in runs.items()},
        "pd_stall_over_quiet_p99": pd["stall_ratio"],
        "pd_stall_goal_met": pd["stall_ratio"] <= 1.5,
        "ttft_cost": pd["ttft_cost"],
        "remote_prefills": pd["remote_prefills"],
        "colocated": local,
        "pd_run": pd,
        "pd_runs": runs,
    }
    for transport, figures in runs.items():
        print(
            f"P/D ({transport}): typical worst stall {figures['typical_worst_stall_ms']:.1f} ms = "
            f"{figures['stall_ratio']:.2f} x its quiet p99 {figures['quiet_itl_p99_ms']:.1f} ms (goal <= 1.5; "
            f"co-located {local['stall_ratio']:.2f}); image TTFT p50 {figures['image_ttft_p50_ms']:.0f} ms against "
            f"{local['image_ttft_p50_ms']:.0f} ms co-located ({figures['ttft_cost']:.2f}x); "
            f"{figures['remote_prefills']:.0f} remote prefills"
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="epd bench burst", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--itl-target-ms",
        type=float,
        default=0.0,
        help="the second run's target (default: --target-factor x the first run's quiet p99); with --pd both "
        "clusters' (default none)",
    )
    parser.add_argument("--target-factor", type=float, default=2.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--image-size", default="1400x1100", help="WIDTHxHEIGHT")
    parser.add_argument("--quiet-tokens", type=int, default=200, help="tokens per stream before the burst")
    parser.add_argument("--stream-tokens", type=int, default=650, help="tokens per stream in all")
    parser.add_argument("--bursts", type=int, default=3, help="episodes per run (streams, then a burst)")
    parser.add_argument("--image-tokens", type=int, default=16, help="tokens per image request")
    parser.add_argument("--text-width", type=int, default=256, help="the model's hidden size (multiple of 64)")
    parser.add_argument("--text-layers", type=int, default=4, help="the model's layers")
    parser.add_argument(
        "--compute-nice", type=int, help="every service's EPD_COMPUTE_NICE (default: each service's own default)"
    )
    parser.add_argument("--engine-process", action="store_true", help="workers with EPD_ENGINE_PROCESS=on (else off)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 2 streams, 2 small images")
    parser.add_argument(
        "--pd", action="store_true", help="co-located against prefill/decode disaggregation, each pool on its core"
    )
    parser.add_argument(
        "--pd-min-prefill-tokens", type=int, default=256, help="with --pd: the router's EPD_PD_MIN_PREFILL_TOKENS"
    )
    parser.add_argument(
        "--kv-transport",
        default="grpc",
        help="with --pd: the P/D clusters' EPD_KV_TRANSPORT, one cluster each (grpc, dist, or grpc,dist)",
    )
    args = parser.parse_args(argv)
    kv_transports = tuple(dict.fromkeys(t.strip() for t in args.kv_transport.split(",") if t.strip()))
    if not kv_transports or not set(kv_transports) <= set(TRANSPORTS):
        parser.error(f"--kv-transport: {args.kv_transport!r} is not a comma-separated list of {', '.join(TRANSPORTS)}")
    if args.quick:
        args.streams, args.images, args.image_size = 2, 2, "448x336"
        args.quiet_tokens, args.stream_tokens, args.image_tokens, args.bursts = 30, 90, 4, 1
        args.text_width, args.text_layers = 64, 2
        args.pd_min_prefill_tokens = min(args.pd_min_prefill_tokens, 128)  # a 448x336 image prompt: ~230 tokens
    width, height = (int(v) for v in args.image_size.lower().split("x"))
    settings = Settings(
        args.streams,
        args.images,
        (width, height),
        args.quiet_tokens,
        args.stream_tokens,
        args.image_tokens,
        args.bursts,
    )
    from services.launch.local import free_port
    from services.models.tiny_model import make_tiny_model
    from tests import media_factory
    from tests.redis_server import RedisServer

    env = {"EPD_ENGINE_PROCESS": str(args.engine_process).lower()}
    if args.compute_nice is not None:  # else each service's own default, as `epd up` starts them
        env["EPD_COMPUTE_NICE"] = str(args.compute_nice)
    images = [media_factory.jpeg(width, height, seed=1000 + i) for i in range(args.images)]
    redis = RedisServer(free_port())
    redis.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_tiny_model(
                Path(tmp) / "model", "qwen2-vl", text_width=args.text_width, text_layers=args.text_layers
            )
            if args.pd:
                colocated, splits = asyncio.run(
                    run_pd(
                        model, redis.url, settings, images, args.pd_min_prefill_tokens, env, args.itl_target_ms,
                        kv_transports,
                    )
                )  # fmt: skip
            else:
                plain, targeted, target_ms = asyncio.run(
                    run_both(model, redis.url, settings, images, args.itl_target_ms, args.target_factor, env)
                )
    finally:
        redis.stop()
    if args.pd:
        print(json.dumps(_pd_report(colocated, splits, settings, args.pd_min_prefill_tokens, args.itl_target_ms)))
        return 0
    base, with_target = summarize(plain, settings), summarize(targeted, settings)
    print_run("no target", base)
    print_run("target", with_target)
    print(f"with EPD_ITL_TARGET_MS={target_ms:g}, the worker's step-cost metrics:\n{targeted.worker_metrics}")
    budgets = metric(targeted.worker_metrics, "epd_step_prefill_budget_tokens_count")
    with_target["budgeted_steps"] = budgets
    budgeted = metric(targeted.worker_metrics, "epd_step_prefill_budget_tokens_sum")
    with_target["mean_prefill_budget"] = budgeted / budgets if budgets else 0.0
    with_target["throughput_ratio"] = with_target["tokens_per_s"] / base["tokens_per_s"]
    with_target["target_over_quiet_p99"] = target_ms / with_target["quiet_itl_p99_ms"]
    base["throughput_ratio"] = 1.0
    print(
        json.dumps(
            {
                "itl_target_ms": target_ms,
                "stall_ratio": {"no_target": base["stall_ratio"], "target": with_target["stall_ratio"]},
                "throughput_ratio": {"no_target": 1.0, "target": with_target["throughput_ratio"]},
                "no_target": base,
                "target": with_target,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
