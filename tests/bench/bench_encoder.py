"""Benchmark: the encoder's batching and the three embedding paths, same run, with ratios.

    epd bench encoder [--quick] [--model DIR] [--images 96] [--budgets 512,2048,16384] [--sizes-mb 1,4,20]

1. Vision tower throughput: the same images (prepared once, mixed sizes) encoded one per call
   versus through the `Batcher` under each token budget (the last, the default 16384, is the
   headline `images_per_s_batched`): images/s and the ratios.
2. Embedding transfer from this process (as an encoder) to a receiver in its own process (the
   worker's receive path: chunked gRPC stream, or gloo send/recv with gRPC control), and through
   Redis (`EmbeddingCache.put` here, `get` by a second cache with an empty memory tier): MB/s and
   per-item latency for each size, and the gloo and Redis figures relative to gRPC.
3. A video's preprocessing with the preprocessing cache missing versus hitting (tests/bench/bench_video.py).
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.transport_grpc import Embedding
from services.encoder.push import Channels, DistPush, push_grpc
from tests.bench.bench_video import bench_video_preprocess
from tests.bench.receiver import ReceiverProcess, start_redis


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epd bench encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: a tiny random Qwen2-VL built offline)")
    parser.add_argument("--quick", action="store_true", help="a few images and small tensors, for a smoke run")
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument(
        "--budgets",
        default="512,2048,16384",
        help="encoder-token budgets to batch under (the last is the reported default)",
    )
    parser.add_argument("--sizes-mb", default="1,4,20", help="embedding sizes to transfer, MB")
    parser.add_argument("--repeats", type=int, default=10, help="transfers per size and path")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.sizes_mb, args.repeats, args.budgets = 8, "0.25,1", 2, "512,16384"
    return args


def _images(count: int) -> list[Any]:
    from PIL import Image

    from tests import media_factory

    sides = [(224, 224), (448, 336), (160, 640), (512, 512), (96, 128), (320, 240)]
    return [Image.fromarray(media_factory.pattern(*sides[i % len(sides)], seed=i), "RGB") for i in range(count)]


def bench_batching(model_dir: Path, count: int, budgets: list[int]) -> dict[str, float]:
    """Images/s through the tower, one per call versus batched by the Batcher under each budget."""
    from services.common.model_info import load_model_info
    from services.encoder.batcher import Batcher, BatchItem
    from services.models.vision_runner import VisionRunner

    info = load_model_info(model_dir)
    runner = VisionRunner(info.adapter, info.adapter.load_model())
    images = _images(count)
    inputs = [runner.prepare(image) for image in images]
    tokens = [info.adapter.image_tokens(image.width, image.height).num_tokens for image in images]
    runner.encode_inputs(inputs[:2])  # warm-up
    start = time.perf_counter()
    for item in inputs:
        runner.encode_inputs([item])
    single_s = time.perf_counter() - start

    async def batched(budget: int, sizes: list[int]) -> float:
        batcher = Batcher(runner.encode_inputs, budget, 0.002, on_batch=lambda stats: sizes.append(stats.items))
        batcher.start()
        begin = time.perf_counter()
        await asyncio.gather(*(batcher.submit(BatchItem(f"item-{i}", tokens[i], inputs[i])) for i in range(count)))
        seconds = time.perf_counter() - begin
        await batcher.close()
        return seconds

    out = {"images": count, "mean_image_tokens": statistics.mean(tokens), "images_per_s_single": count / single_s}
    for budget in budgets:
        sizes: list[int] = []
        rate = count / asyncio.run(batched(budget, sizes))
        out[f"images_per_s_budget_{budget}"] = rate
        out[f"mean_batch_items_budget_{budget}"] = statistics.mean(sizes)
    best = max(budgets, key=lambda b: out[f"images_per_s_budget_{b}"])
    out["images_per_s_batched"] = out[f"images_per_s_budget_{budgets[-1]}"]
    out["batched_over_single"] = out["images_per_s_batched"] / out["images_per_s_single"]
    out["best_budget"] = best
    out["best_batched_over_single"] = out[f"images_per_s_budget_{best}"] / out["images_per_s_single"]
    return out


def _tensor(nbytes: int, seed: int) -> torch.Tensor:
    rows = max(1, nbytes // (4 * 1024))
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed))


async def _time_pushes(push: Any, tensors: list[torch.Tensor], tag: str) -> list[float]:
    seconds = []
    for i, tensor in enumerate(tensors):
        start = time.perf_counter()
        await push([Embedding(f"{tag}-{i}", tensor)])
        seconds.append(time.perf_counter() - start)
    return seconds


def bench_transfers(sizes_mb: list[float], repeats: int, redis_url: str) -> dict[str, float]:
    """MB/s and per-item latency of the gRPC, gloo and Redis paths for each size."""
    out: dict[str, float] = {}
    with ReceiverProcess() as receiver:

        async def run() -> None:
            channels = Channels()
            dist = DistPush(channels, "gloo", "127.0.0.1", timeout_s=60)
            paths = {
                "grpc": lambda items: push_grpc(channels, receiver.address, items, 60),
                "gloo": lambda items: dist.push(receiver.address, items, 60),
            }
            for size in sizes_mb:
                tensors = [_tensor(int(size * 1e6), seed) for seed in range(repeats + 1)]
                for name, push in paths.items():
                    seconds = (await _time_pushes(push, tensors, f"{name}-{size}"))[1:]  # first: warm-up
                    _record(out, name, size, tensors[0], seconds)
            dist.close()
            await channels.close()

        asyncio.run(run())
    reader = EmbeddingCache(CacheSettings(redis_url, "bench", max_bytes=0, max_item_bytes=1 << 30, socket_timeout_s=30))
    writer = EmbeddingCache(CacheSettings(redis_url, "bench", max_bytes=0, max_item_bytes=1 << 30, socket_timeout_s=30))
    for size in sizes_mb:
        tensors = [_tensor(int(size * 1e6), seed) for seed in range(repeats + 1)]
        seconds = []
        for i, tensor in enumerate(tensors):
            start = time.perf_counter()
            writer.put(f"redis-{size}-{i}", tensor)
            got = reader.get(f"redis-{size}-{i}").tensor
            seconds.append(time.perf_counter() - start)
            if got is None or not torch.equal(got, tensor):
                raise RuntimeError("the Redis path lost or changed an embedding")
        _record(out, "redis", size, tensors[0], seconds[1:])
    writer.close()
    reader.close()
    return out


def _record(out: dict[str, float], path: str, size_mb: float, tensor: torch.Tensor, seconds: list[float]) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    median = statistics.median(seconds)
    out[f"{path}_{size_mb:g}mb_item_ms"] = 1000 * median
    out[f"{path}_{size_mb:g}mb_mb_per_s"] = nbytes / 1e6 / median


def _ratios(figures: dict[str, float], sizes_mb: list[float]) -> dict[str, float]:
    ratios = {}
    for size in sizes_mb:
        base = figures[f"grpc_{size:g}mb_mb_per_s"]
        for path in ("gloo", "redis"):
            ratios[f"{path}_over_grpc_{size:g}mb"] = figures[f"{path}_{size:g}mb_mb_per_s"] / base
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from services.models.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", "qwen2-vl")
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        batching = bench_batching(model_dir, args.images, budgets)
        print(
            f"vision tower, {batching['images']} images of {batching['mean_image_tokens']:.0f} tokens on average: "
            f"one per call {batching['images_per_s_single']:.1f} img/s",
            flush=True,
        )
        for budget in budgets:
            rate = batching[f"images_per_s_budget_{budget}"]
            print(
                f"  batched under {budget} tokens: {rate:.1f} img/s (x{rate / batching['images_per_s_single']:.2f}, "
                f"{batching[f'mean_batch_items_budget_{budget}']:.1f} images per call)",
                flush=True,
            )
        video = bench_video_preprocess(model_dir, args.quick)
        print(
            f"video preprocessing ({video['video']}, {video['video_tokens']} tokens): cache miss "
            f"{video['video_preprocess_miss_ms']:.1f} ms, hit {video['video_preprocess_hit_ms']:.1f} ms "
            f"(x{video['video_preprocess_miss_over_hit']:.1f})",
            flush=True,
        )
        with start_redis() as redis_url:
            transfers = bench_transfers(sizes, args.repeats, redis_url)
    for size in sizes:
        line = ", ".join(
            f"{p} {transfers[f'{p}_{size:g}mb_mb_per_s']:.0f} MB/s ({transfers[f'{p}_{size:g}mb_item_ms']:.1f} ms/item)"
            for p in ("grpc", "gloo", "redis")
        )
        print(f"embedding of {size:g} MB: {line}", flush=True)
    result = {**batching, **video, **transfers, **_ratios(transfers, sizes)}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
