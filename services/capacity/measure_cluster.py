"""`epd profile`'s second part, a real local cluster (router, one encoder, one worker, a private Redis; free
ports), as `epd up` and `epd bench traffic` start it: embeddings pushed to the worker by gRPC and gloo and through
Redis (put, get) at several sizes; then probe requests through the router (text and image, short and long),
whose measured time minus what the first part's curves predict is fitted as the serving overhead (`profile.py`).
A probe's time is the lower quartile of its rounds (`probe_quartiles`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.capacity import profile as prof
from services.capacity.fit import FitError, LinearFit, fit
from services.capacity.measure_model import WORDS, synthetic_png
from services.capacity.profile_options import Log, ProfileOptions, torch_dtype


@dataclass(frozen=True)
class Probe:
    """A probe request: images (width, height), about `words` words of text, `output_tokens` generated."""

    name: str
    images: tuple[tuple[int, int], ...]
    words: int
    output_tokens: int


PROBES = (
    Probe("text", (), 40, 1),
    Probe("long text", (), 900, 1),
    Probe("text, 48 out", (), 40, 48),
    Probe("text, 96 out", (), 40, 96),
    Probe("small image", ((500, 375),), 20, 1),
    Probe("large image", ((1000, 750),), 20, 1),
    Probe("two images", ((500, 375), (500, 375)), 20, 1),
    Probe("image, 32 out", ((500, 375),), 20, 32),
)


@contextlib.contextmanager
def running_cluster(model_dir: Path, options: ProfileOptions) -> Iterator[Any]:
    """Router, one encoder, one worker and a private Redis on free ports, logs in a temporary folder; stopped after.

    As `epd up` starts them but with `EPD_COMPUTE_NICE=0`: at nice 10 (the encoder's default) the tower gets a
    fraction of a core whenever anything else on the machine is busy, and the profile would measure that."""
    from services.launch.local import ClusterSpec, free_port, start_cluster

    env = {
        "EPD_HTTP_PORT": "0",
        "EPD_DEVICE": options.device,
        "EPD_DTYPE": options.dtype,
        "EPD_LOG_LEVEL": "WARNING",
        "EPD_COMPUTE_NICE": "0",  # costs, not priorities: a niced encoder on a shared box measures its neighbours
    }
    with tempfile.TemporaryDirectory(prefix="epd-profile-") as logs:
        spec = ClusterSpec(
            model_dir,
            redis_url=f"redis://127.0.0.1:{free_port()}/0",
            free_ports=True,
            metrics_port=0,
            env=env,
            log_dir=Path(logs),
        )
        cluster = start_cluster(spec, options.startup_timeout_s)
        try:
            yield cluster
        finally:
            cluster.stop()


def measure_transfers(cluster: Any, hidden: int, options: ProfileOptions, log: Log) -> list[dict[str, Any]]:
    """Seconds to move an embedding of each size to the worker by gRPC and gloo, and into / out of Redis."""
    import torch

    from services.common.embedding_cache import CacheSettings, EmbeddingCache
    from services.common.transport_grpc import Embedding
    from services.encoder.push import Channels, DistPush, push_grpc

    dtype = torch_dtype(options.dtype)
    worker = cluster.workers[0].address
    points: list[dict[str, Any]] = []

    def tensors(megabytes: float) -> list[Any]:
        rows = max(1, round(megabytes * 1e6 / (hidden * dtype.itemsize)))
        return [torch.randn(rows, hidden).to(dtype) for _ in range(options.repeats + 1)]

    def record(transport: str, tensor: Any, seconds: list[float]) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        fastest = min(seconds[1:])  # the first is a warm-up
        points.append({"transport": transport, "megabytes": nbytes / 1e6, "seconds": fastest})

    async def pushes() -> None:
        channels = Channels()
        dist = DistPush(channels, "gloo", "127.0.0.1", timeout_s=60)
        paths = {
            "grpc": lambda items: push_grpc(channels, worker, items, 60),
            "gloo": lambda items: dist.push(worker, items, 60),
        }
        try:
            for megabytes in options.transfer_megabytes:
                batch = tensors(megabytes)
                for name, push in paths.items():
                    seconds = []
                    for n, tensor in enumerate(batch):
                        start = time.perf_counter()
                        await push([Embedding(f"profile-{name}-{megabytes}-{n}", tensor)])
                        seconds.append(time.perf_counter() - start)
                    record(name, batch[0], seconds)
        finally:
            dist.close()
            await channels.close()

    asyncio.run(pushes())
    settings = CacheSettings(cluster.redis_url, "epd-profile", max_bytes=0, max_item_bytes=1 << 31, socket_timeout_s=30)
    writer, reader = EmbeddingCache(settings), EmbeddingCache(settings)
    try:
        for megabytes in options.transfer_megabytes:
            batch = tensors(megabytes)
            put_s, get_s = [], []
            for n, tensor in enumerate(batch):
                key = f"profile-{megabytes}-{n}-{time.time_ns()}"
                start = time.perf_counter()
                writer.put(key, tensor)
                put_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                got = reader.get(key).tensor
                get_s.append(time.perf_counter() - start)
                if got is None:
                    raise RuntimeError(f"Redis at {cluster.redis_url} lost a {megabytes} MB embedding")
            record("redis_put", batch[0], put_s)
            record("redis_get", batch[0], get_s)
    finally:
        writer.close()
        reader.close()
    for megabytes in options.transfer_megabytes:
        row = [p for p in points if abs(p["megabytes"] - megabytes) / megabytes < 0.05]
        text = ", ".join(f"{p['transport']} {1000 * p['seconds']:.1f} ms" for p in row)
        log(f"  embedding of {megabytes:g} MB: {text}")
    return points


def measure_serving(
    address: str, adapter: Any, partial: prof.Profile, options: ProfileOptions, log: Log
) -> list[dict[str, Any]]:
    """Probe requests through the router: measured seconds, what the in-process curves predict, the residual.

    Rounds of every probe once (the first a warm-up), so a burst of other work on the machine slows a round of
    all probes rather than every request of one, which `probe_quartiles` then leaves out.
    """
    from services.client import Client, user_request

    points: list[dict[str, Any]] = []
    seed = iter(range(1, 1 << 30))
    with Client(address) as client:
        client.wait_ready()
        for round_ in range(options.probe_repeats + 1):
            for probe in PROBES:
                rng = random.Random(next(seed))
                text = " ".join(rng.choice(WORDS) for _ in range(probe.words))
                images = [synthetic_png(w, h, next(seed)) for w, h in probe.images]
                request = user_request(text, images, max_tokens=probe.output_tokens)
                request.sampling.ignore_eos = True
                request.cache_salt = f"profile-{time.time_ns()}"
                start = time.perf_counter()
                answer = client.generate(request, timeout_s=300)
                seconds = time.perf_counter() - start
                if not round_:
                    continue  # warm-up
                usage = answer.final.usage
                sizes = [adapter.image_tokens(w, h).num_tokens for w, h in probe.images]
                predicted = parts_seconds(
                    partial, usage.prompt_tokens, usage.completion_tokens, probe.images, sizes, adapter.embedding_width
                )
                points.append(
                    {
                        "probe": probe.name,
                        "prompt_tokens": usage.prompt_tokens,
                        "output_tokens": usage.completion_tokens,
                        "images": len(probe.images),
                        "image_tokens": usage.image_tokens,
                        "measured_s": seconds,
                        "parts_s": predicted,
                        "residual_s": seconds - predicted,
                    }
                )
    for probe in PROBES:
        times = [p["measured_s"] for p in points if p["probe"] == probe.name]
        low, middle = sorted(times)[(len(times) - 1) // 4], statistics.median(times)
        log(f"  probe {probe.name}: {1000 * low:.1f} ms (lower quartile), median {1000 * middle:.1f} ms")
    return points


def fit_serving(points: list[dict[str, Any]]) -> LinearFit:
    """The serving curve, in two stages so noisy image probes cannot bend the per-token term every request pays:
    the text-only probes fit `1 + output_tokens`; what the image probes leave beyond that fits `images +
    image_tokens` (only `image_tokens` when the probes cannot tell them apart: a small pixel cap gives the large
    probe image no more tokens than the small one)."""
    text = [p for p in points if not p["images"]]
    base = fit(text, "residual_s", ("1", "output_tokens"))
    rest = [
        {**p, "image_residual_s": p["residual_s"] - base(output_tokens=p["output_tokens"])}
        for p in points
        if p["images"]
    ]
    per_image = per_token = 0.0
    if rest:
        try:
            extra = fit(rest, "image_residual_s", ("images", "image_tokens"))
        except FitError:
            extra = fit(rest, "image_residual_s", ("image_tokens",))
        per_image, per_token = extra.coefficient("images"), extra.coefficient("image_tokens")
    coefficients = (base.coefficient("1"), base.coefficient("output_tokens"), per_image, per_token)
    curve = LinearFit(prof.SERVING_TERMS, coefficients)
    rms = math.sqrt(statistics.mean((p["residual_s"] - curve(**p)) ** 2 for p in points))
    return LinearFit(prof.SERVING_TERMS, coefficients, rms)


def probe_quartiles(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per probe: the request at its residuals' lower quartile. Other work on the machine only ever adds
    time, so the low end is the probe's own cost; a quartile rather than the minimum keeps ordinary jitter in, and
    a burst that slows up to three rounds in four moves no fit."""
    out = []
    for name in dict.fromkeys(p["probe"] for p in points):
        rows = sorted((p for p in points if p["probe"] == name), key=lambda p: p["residual_s"])
        chosen = rows[(len(rows) - 1) // 4]
        out.append({k: v for k, v in chosen.items() if k != "probe"})
    return out


def parts_seconds(
    profile: prof.Profile,
    prompt_tokens: int,
    output_tokens: int,
    images: tuple[tuple[int, int], ...],
    image_tokens: list[int],
    hidden: int,
) -> float:
    """A lone request's in-process parts: encode each image, write it to the cache, push the request's
    embeddings, prefill the prompt, decode the rest at batch 1 (what `serving` is fitted beyond)."""
    row_bytes = hidden * torch_dtype(profile.dtype).itemsize
    seconds = profile.prefill(tokens=prompt_tokens)
    seconds += max(0, output_tokens - 1) * profile.decode(batch=1, context=prompt_tokens + output_tokens / 2)
    for (width, height), tokens in zip(images, image_tokens, strict=True):
        seconds += profile.image_encode_s(width * height / 1e6, tokens)
        seconds += profile.transfer_s("redis_put", tokens * row_bytes)
    return seconds + profile.transfer_s("grpc", sum(image_tokens) * row_bytes)
