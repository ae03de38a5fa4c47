"""Benchmark: a traffic mix (the `epd plan` file format) through a real local cluster; mean request time measured.

    epd bench traffic --traffic FILE [--model DIR] [--requests 40] [--profile FILE] [--seed 0]

Starts the cluster `epd profile` probes (router, one encoder, one worker, a private Redis, free ports), then
sends the mix: each request kind in proportion to its `share` (a seeded order), its images as PNGs of the given
sizes, its text grown until the prompt's text tokens (chat template included, counted as the router counts)
reach `text_tokens`, exactly `output_tokens` generated (eos ignored). `concurrency` closed-loop clients, or
Poisson arrivals at `rate`; a share `reuse` of image items repeats an image sent before (an embedding-cache
hit); every request has its own `cache_salt`, so no prefix-cache hit hides a prefill. A few warm-up requests
first, untimed, then `--repeats` runs of `--requests` fresh requests each. Request time is from sending to the
last response (the `Final`); TTFT to the first token. The mean request time reported is the median of the runs'
means (as `epd bench engine` reports medians of its runs): other work on a shared machine slows a run, not the
figure.

With `--profile` it also prints what `epd plan` predicts for the same file and the ratio. The last line is one
JSON object: `requests` (all runs), `repeats`, `mean_request_s`, `repeat_means_s`, `all_mean_request_s`,
`median_request_s`, `mean_ttft_s`, `per_kind` (label, count, mean_request_s) and, with a profile,
`predicted_request_s` and `predicted_over_measured`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.capacity.traffic import Traffic, load_traffic
from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import generation_pb2, generation_pb2_grpc
from tests import media_factory

WORDS = ["image", "picture", "scene", "light", "colour", "shape", "detail", "object", "person", "street", "house"]


@dataclass
class Planned:
    """One request to send: its kind, the request message, and (after sending) its timings."""

    kind: int
    request: generation_pb2.GenerateRequest
    arrival_s: float = 0.0
    request_s: float = 0.0
    ttft_s: float = 0.0
    tokens: int = 0
    usage: dict[str, int] = field(default_factory=dict)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epd bench traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traffic", type=Path, required=True, help="traffic file (docs/planning.md)")
    parser.add_argument("--model", type=Path, help="model folder (default: the tiny model `epd up` builds)")
    parser.add_argument("--requests", type=int, default=40, help="timed requests per repeat (default 40)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs, fresh requests each; the median of their means is kept"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests first (default 3)")
    parser.add_argument("--profile", type=Path, help="a profile: also print epd plan's prediction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    return parser.parse_args(argv)


def png(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    media_factory.image(width, height, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def kind_order(traffic: Traffic, count: int, rng: random.Random) -> list[int]:
    """`count` kind indexes, each kind's count its share rounded (largest remainder), in a seeded order."""
    exact = [k.share * count for k in traffic.requests]
    counts = [int(e) for e in exact]
    for index in sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)[: count - sum(counts)]:
        counts[index] += 1
    order = [i for i, n in enumerate(counts) for _ in range(n)]
    rng.shuffle(order)
    return order


def build_requests(adapter: Any, traffic: Traffic, order: list[int], rng: random.Random, tag: str) -> list[Planned]:
    """The requests for `order`: text grown to each kind's `text_tokens`, images fresh or (a share `reuse`) reused."""
    from services.client import user_request
    from services.models.base import ChatMessage, ChatPart

    sent: list[tuple[tuple[int, int], bytes]] = []
    planned = []
    for number, index in enumerate(order):
        kind = traffic.requests[index]
        images = []
        for width, height in kind.images:
            same = [data for size, data in sent if size == (width, height)]
            if same and rng.random() < traffic.reuse:
                images.append(rng.choice(same))
            else:
                images.append(png(width, height, seed=rng.randrange(1 << 30)))
                sent.append(((width, height), images[-1]))
        items = [adapter.image_tokens(w, h) for w, h in kind.images]
        words: list[str] = [f"{tag}{number}"]
        while True:
            parts = [ChatPart("image") for _ in items] + [ChatPart("text", " ".join(words))]
            built = adapter.build_prompt([ChatMessage("user", parts)], items)
            if built.text_tokens >= kind.text_tokens:
                break
            words.append(rng.choice(WORDS))
        request = user_request(" ".join(words), images, max_tokens=kind.output_tokens)
        request.sampling.ignore_eos = True
        request.cache_salt = f"bench-traffic-{tag}-{number}-{time.time_ns()}"
        planned.append(Planned(index, request))
    return planned


async def send(stub: Any, item: Planned) -> None:
    start = time.perf_counter()
    async for response in stub.Generate(item.request, timeout=600):
        if response.HasField("chunk"):
            if not item.tokens:
                item.ttft_s = time.perf_counter() - start
            item.tokens += len(response.chunk.token_ids)
        else:
            usage = response.final.usage
            item.usage = {"prompt": usage.prompt_tokens, "image": usage.image_tokens, "text": usage.text_tokens}
    item.request_s = time.perf_counter() - start


async def run_load(address: str, traffic: Traffic, planned: list[Planned], rng: random.Random) -> None:
    """Closed loop (`concurrency` clients, each sending its next request on an answer) or Poisson arrivals."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        await channel.channel_ready()
        stub = generation_pb2_grpc.GenerationStub(channel)
        if traffic.rate is None:
            queue = list(planned)

            async def client() -> None:
                while queue:
                    await send(stub, queue.pop(0))

            await asyncio.gather(*(client() for _ in range(traffic.clients)))
            return
        start, clock, tasks = time.perf_counter(), 0.0, []
        for item in planned:
            item.arrival_s = clock
            await asyncio.sleep(max(0.0, clock - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(send(stub, item)))
            clock += rng.expovariate(traffic.rate)
        await asyncio.gather(*tasks)


def predicted_request_s(model_dir: Path, traffic: Traffic, profile_path: Path) -> float:
    """What `epd plan` predicts for this traffic (its disaggregated mean request time)."""
    from services.capacity.model_sizes import load_sizes
    from services.capacity.plan import make_plan
    from services.capacity.profile import load_profile

    profile = load_profile(profile_path)
    plan = make_plan(load_sizes(model_dir, profile.dtype), traffic, profile)
    assert plan.disaggregated is not None
    return plan.disaggregated.request_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from services.capacity.measure_cluster import running_cluster
    from services.capacity.profile_options import ProfileOptions
    from services.cli_up import DEFAULT_TINY, tiny_model
    from services.models.registry import load_adapter

    traffic = load_traffic(args.traffic)
    model_dir = args.model or tiny_model(DEFAULT_TINY)
    adapter = load_adapter(model_dir)
    rng = random.Random(args.seed)
    warmup = build_requests(adapter, traffic, kind_order(traffic, args.warmup, rng), rng, "w")
    runs = [
        build_requests(adapter, traffic, kind_order(traffic, args.requests, rng), rng, f"t{r}")
        for r in range(args.repeats)
    ]
    options = ProfileOptions(startup_timeout_s=args.startup_timeout)
    with running_cluster(model_dir, options) as cluster:
        asyncio.run(run_load(cluster.address, traffic, warmup, rng))
        start = time.perf_counter()
        for run in runs:
            asyncio.run(run_load(cluster.address, traffic, run, rng))
        wall_s = time.perf_counter() - start
    timed = [p for run in runs for p in run]
    times = [p.request_s for p in timed]
    run_means = [statistics.mean(p.request_s for p in run) for run in runs]
    result: dict[str, Any] = {
        "traffic": str(args.traffic),
        "requests": len(timed),
        "repeats": len(runs),
        "wall_s": wall_s,
        "mean_request_s": statistics.median(run_means),
        "repeat_means_s": run_means,
        "all_mean_request_s": statistics.mean(times),
        "median_request_s": statistics.median(times),
        "mean_ttft_s": statistics.mean(p.ttft_s for p in timed),
        "per_kind": [],
    }
    load = f"rate {traffic.rate:g}/s" if traffic.rate is not None else f"{traffic.clients} closed-loop client(s)"
    print(
        f"{args.traffic}: {len(runs)} x {args.requests} requests, {load}, reuse {traffic.reuse:g}, in {wall_s:.1f} s; "
        f"mean of each run: {', '.join(f'{1000 * m:.1f}' for m in run_means)} ms"
    )
    for index, kind in enumerate(traffic.requests):
        mine = [p for p in timed if p.kind == index]
        if not mine:
            continue
        mean = statistics.mean(p.request_s for p in mine)
        usage = mine[0].usage
        result["per_kind"].append({"label": kind.label(), "count": len(mine), "mean_request_s": mean})
        print(
            f"  {kind.label():<42} x{len(mine):<3} mean {1000 * mean:8.1f} ms  (prompt {usage.get('prompt')} tokens: "
            f"{usage.get('text')} text, {usage.get('image')} image)"
        )
    print(
        f"measured mean request {1000 * result['mean_request_s']:.1f} ms (the median run's; all requests: mean "
        f"{1000 * result['all_mean_request_s']:.1f} ms, median {1000 * result['median_request_s']:.1f} ms), "
        f"mean TTFT {1000 * result['mean_ttft_s']:.1f} ms"
    )
    if args.profile is not None:
        predicted = predicted_request_s(model_dir, traffic, args.profile)
        result["predicted_request_s"] = predicted
        result["predicted_over_measured"] = predicted / result["mean_request_s"]
        print(
            f"epd plan predicts {1000 * predicted:.1f} ms: predicted / measured = "
            f"{result['predicted_over_measured']:.3f}"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
