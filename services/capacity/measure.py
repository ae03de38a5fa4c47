"""`epd profile`'s measurements: the model's costs on this machine through the real code paths, fitted.

1. In this process, with the services' torch thread count: images through the encoder's decode
   (`decode_image`) and `VisionRunner` (prepare, tower); prompts through the worker `Engine` to their first
   token (prefill); decode steps of the `Engine` at several batches and contexts.
2. A real local cluster (router, one encoder, one worker, a private Redis; free ports), as `epd up` and
   `epd bench traffic` start it: embeddings pushed to the worker by gRPC and gloo and through Redis (put, get)
   at several sizes; then probe requests through the router (text and image, short and long), whose measured
   time minus what part 1's curves predict is fitted as the serving overhead (see `profile.py`).

Other work on the machine only ever adds time, so a part's timing is the fastest of `repeats` runs after a
warm-up (as `timeit` takes), and a probe's the lower quartile of its rounds (`probe_quartiles`); every fit is
least squares with coefficients >= 0. Each request is unique (its own `cache_salt`, fresh image pixels), so no
prefix or embedding cache hit hides a cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.capacity import profile as prof
from services.capacity.fit import FitError, LinearFit, fit

Log = Callable[[str], None]
WORDS = ("image", "picture", "scene", "light", "colour", "shape", "detail", "object", "person", "street", "house")


@dataclass(frozen=True)
class ProfileOptions:
    """Sizes measured and how often. Image sides are widths of 4:3 images (height = 3/4 width); like photos they
    are no multiple of the model's patch, so the processor really resizes them."""

    image_sides: tuple[int, ...] = (250, 500, 750, 1000)
    prefill_tokens: tuple[int, ...] = (64, 256, 1024, 2048, 4096)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_steps: int = 16
    transfer_megabytes: tuple[float, ...] = (0.25, 1.0, 4.0, 16.0)
    repeats: int = 5
    probe_repeats: int = 12
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0
    """torch threads for part 1; 0: what each service of a one-encoder, one-worker `epd up` gets."""
    startup_timeout_s: float = 180.0

    def problems(self) -> list[str]:
        """What keeps these sizes from determining the curves (`profile.py`'s terms); empty when nothing does."""
        needs = [
            ("image sides", len(set(self.image_sides)), len(prof.TOWER_TERMS)),
            ("prefill sizes", len(set(self.prefill_tokens)), len(prof.PREFILL_TERMS)),
            ("decode batches", len(set(self.decode_batches)), 2),
            ("decode contexts", len(set(self.decode_contexts)), 2),
            ("transfer sizes", len(set(self.transfer_megabytes)), len(prof.TRANSPORT_TERMS)),
        ]
        return [f"{have} {name} cannot fit a curve: give at least {need}" for name, have, need in needs if have < need]


QUICK = ProfileOptions(
    image_sides=(160, 320, 480),
    prefill_tokens=(32, 128, 384),
    decode_batches=(1, 4),
    decode_contexts=(64, 256),
    decode_steps=4,
    transfer_megabytes=(0.25, 1.0),
    repeats=1,
    probe_repeats=1,
)
"""A smoke run: the same steps at the smallest sizes."""


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


def service_threads() -> int:
    """torch threads each service of a one-encoder, one-worker local cluster gets (services/launch/local.py)."""
    return max(1, (os.cpu_count() or 1) // 2)


def measure_profile(model_dir: Path, options: ProfileOptions | None = None, log: Log = print) -> prof.Profile:
    """Measure and fit everything (module docstring; default options: `ProfileOptions()`); `log` gets one line
    per size measured. Needs redis-server (a private one is started on a free port)."""
    import torch

    from services.models.registry import load_adapter, model_revision

    options = options or ProfileOptions()
    started = time.perf_counter()
    threads = options.threads or service_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    adapter = load_adapter(Path(model_dir))
    try:
        model = adapter.load_model(options.device, _torch_dtype(options.dtype))
        points: dict[str, list[dict[str, Any]]] = {}
        points["vision"] = measure_vision(adapter, model, options, log)
        engine = _engine(adapter, model, options)
        points["prefill"] = measure_prefill(engine, adapter, options, log)
        points["decode"] = measure_decode(engine, adapter, options, log)
        del engine, model  # the cluster's own processes load the model next (one GPU holds one copy at a time)
        gc.collect()
        if options.device.startswith("cuda"):
            torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(before)
    curves = _engine_curves(points)
    with running_cluster(Path(model_dir), options) as cluster:
        points["transfer"] = measure_transfers(cluster, adapter.hidden_size, options, log)
        transfer = points["transfer"]
        transports = {
            name: fit([p for p in transfer if p["transport"] == name], "seconds", prof.TRANSPORT_TERMS, relative=True)
            for name in prof.TRANSPORTS
        }
        partial = prof.Profile(
            model={}, hardware={}, dtype=options.dtype, transports=transports, serving=_zero(), **curves
        )
        points["serving"] = measure_serving(cluster.address, adapter, partial, options, log)
    serving = fit_serving(probe_quartiles(points["serving"]))
    return replace(
        partial,
        model={
            "dir": str(model_dir),
            "model_type": adapter.model_type,
            "hidden_size": adapter.hidden_size,
            "revision": model_revision(Path(model_dir)),
        },
        hardware=_hardware(options, threads),
        serving=serving,
        points=points,
        measured_s=time.perf_counter() - started,
    )


def _engine_curves(points: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "prepare": fit(points["vision"], "prepare_s", prof.PREPARE_TERMS, relative=True),
        "tower": fit(points["vision"], "tower_s", prof.TOWER_TERMS, relative=True),
        "prefill": fit(points["prefill"], "seconds", prof.PREFILL_TERMS, relative=True),
        "decode": fit(points["decode"], "step_s", prof.DECODE_TERMS, relative=True),
    }


def _zero() -> LinearFit:
    return LinearFit(prof.SERVING_TERMS, (0.0,) * len(prof.SERVING_TERMS))


# ----- part 1: in this process -----


def measure_vision(adapter: Any, model: Any, options: ProfileOptions, log: Log) -> list[dict[str, float]]:
    """Per image size: decode + prepare seconds and tower seconds (the fastest repeat each), tokens, megapixels."""
    from services.common.image_decode import decode_image
    from services.common.media_types import MediaLimits
    from services.models.vision_runner import VisionRunner

    runner = VisionRunner(adapter, model)
    limits = MediaLimits()
    points = []
    for index, width in enumerate(options.image_sides):
        height = max(1, width * 3 // 4)
        tokens = adapter.image_tokens(width, height).num_tokens

        def prepare(seed: int, width: int = width, height: int = height) -> tuple[float, Any]:
            data = synthetic_png(width, height, seed)
            start = time.perf_counter()
            inputs = runner.prepare(decode_image(data, limits).image)
            return time.perf_counter() - start, inputs

        _, inputs = prepare(10_000 + index)  # warm-up
        runner.encode_inputs([inputs])
        prepare_s, tower_s = [], []
        for repeat in range(options.repeats):
            seconds, inputs = prepare(index * 100 + repeat)
            prepare_s.append(seconds)
            start = time.perf_counter()
            runner.encode_inputs([inputs])
            tower_s.append(time.perf_counter() - start)
        point = {
            "width": width,
            "height": height,
            "megapixels": width * height / 1e6,
            "tokens": tokens,
            "prepare_s": min(prepare_s),
            "tower_s": min(tower_s),
        }
        log(
            f"  image {width}x{height} ({tokens} tokens): prepare {1000 * point['prepare_s']:.1f} ms, "
            f"tower {1000 * point['tower_s']:.1f} ms"
        )
        points.append(point)
    return points


def measure_prefill(engine: Any, adapter: Any, options: ProfileOptions, log: Log) -> list[dict[str, float]]:
    """Per prompt length: seconds from `add_request` to the first token (all prefill steps)."""
    from services.worker.engine.request import EngineRequest, SamplingOptions

    points = []
    counter = iter(range(1 << 30))
    for tokens in options.prefill_tokens:
        ids = prompt_ids(adapter, tokens, seed=tokens)
        seconds = []
        for repeat in range(options.repeats + 1):
            request_id = f"prefill-{tokens}-{next(counter)}"
            sampling = SamplingOptions(max_tokens=1, ignore_eos=True)
            request = EngineRequest(request_id, ids, sampling=sampling, cache_salt=request_id)  # no prefix hits
            start = time.perf_counter()
            engine.add_request(request)
            while engine.has_work():
                engine.step()
            if repeat:  # the first is a warm-up
                seconds.append(time.perf_counter() - start)
        points.append({"tokens": tokens, "seconds": min(seconds)})
        log(f"  prefill {tokens} tokens: {1000 * points[-1]['seconds']:.1f} ms")
    return points


def measure_decode(engine: Any, adapter: Any, options: ProfileOptions, log: Log) -> list[dict[str, float]]:
    """Per (batch, context): seconds per decode step once every sequence is past its prefill (the fastest of
    `repeats` runs of `decode_steps` steps)."""
    from services.worker.engine.request import EngineRequest, SamplingOptions

    points = []
    for batch in options.decode_batches:
        for context in options.decode_contexts:
            ids = prompt_ids(adapter, context, seed=context)
            names = [f"decode-{batch}-{context}-{i}" for i in range(batch)]
            # enough tokens that none ends while the others still prefill, nor while it is timed
            longest = options.decode_steps * (options.repeats + 1) + 8 + batch * context // 512
            sampling = SamplingOptions(max_tokens=longest, ignore_eos=True)
            for name in names:
                engine.add_request(EngineRequest(name, ids, sampling=sampling, cache_salt=name))
            started: set[str] = set()
            while len(started) < batch:  # prefill every sequence
                started.update(out.request_id for out in engine.step() if out.new_token_ids)
            engine.step()  # one step with every sequence decoding, untimed
            steps = []
            for _ in range(options.repeats):
                start = time.perf_counter()
                for _ in range(options.decode_steps):
                    engine.step()
                steps.append((time.perf_counter() - start) / options.decode_steps)
            for name in names:
                engine.abort(name)
            mean_context = context + 2 + options.decode_steps * (options.repeats + 1) / 2
            points.append({"batch": batch, "context": mean_context, "step_s": min(steps)})
            log(f"  decode batch {batch}, context {context}: {1000 * points[-1]['step_s']:.2f} ms per step")
    return points


def _engine(adapter: Any, model: Any, options: ProfileOptions) -> Any:
    """An engine configured as a worker with default settings, with room for the largest measurement."""
    from services.worker.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
    from services.worker.engine.engine import Engine

    kv_bytes = 0  # CUDA: sized from free memory, as the worker does
    if not options.device.startswith("cuda"):
        from services.worker.engine.attention.kv_cache import KVShape

        per_token = KVShape.of(model).block_bytes(1, _torch_dtype(options.dtype))
        largest = max(
            max(options.prefill_tokens) + 64,
            max(options.decode_batches) * (max(options.decode_contexts) + options.decode_steps * 8 + 64),
        )
        kv_bytes = max(CPU_KV_CACHE_BYTES, 2 * largest * per_token)
    return Engine(adapter, model, EngineConfig(kv_cache_bytes=kv_bytes, dtype=options.dtype, device=options.device))


def prompt_ids(adapter: Any, tokens: int, seed: int) -> list[int]:
    """Token ids of a real chat prompt cut or grown to `tokens` (seeded words, the adapter's template)."""
    from services.models.base import ChatMessage, ChatPart

    rng = random.Random(seed)
    words = max(8, tokens)
    while True:
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        ids = adapter.build_prompt([ChatMessage("user", [ChatPart("text", text)])], []).token_ids
        if len(ids) >= tokens:
            return list(ids[:tokens])
        words *= 2


def synthetic_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of a smooth gradient with light seeded noise (compresses like a photo's PNG, not like a flat fill)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(xx * 255 / max(width - 1, 1) + 40 * c) % 256 for c in range(3)], axis=-1)
    base += (yy * 128 / max(height - 1, 1))[..., None]
    pixels = np.clip(base + rng.integers(-12, 13, size=(height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


# ----- part 2: a real cluster -----


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

    dtype = _torch_dtype(options.dtype)
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
                    partial, usage.prompt_tokens, usage.completion_tokens, probe.images, sizes, adapter.hidden_size
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
    row_bytes = hidden * _torch_dtype(profile.dtype).itemsize
    seconds = profile.prefill(tokens=prompt_tokens)
    seconds += max(0, output_tokens - 1) * profile.decode(batch=1, context=prompt_tokens + output_tokens / 2)
    for (width, height), tokens in zip(images, image_tokens, strict=True):
        seconds += profile.image_encode_s(width * height / 1e6, tokens)
        seconds += profile.transfer_s("redis_put", tokens * row_bytes)
    return seconds + profile.transfer_s("grpc", sum(image_tokens) * row_bytes)


def _torch_dtype(name: str) -> Any:
    from services.capacity.model_sizes import DTYPES

    return DTYPES[name]


def _hardware(options: ProfileOptions, threads: int) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": options.device,
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if options.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info
