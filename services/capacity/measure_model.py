"""`epd profile`'s first part, in this process with the services' torch thread count: images through the
encoder's decode (`decode_image`) and `VisionRunner` (prepare, tower); prompts through the worker `Engine` to
their first token (prefill); decode steps of the `Engine` at several batches and contexts. A timing is the
fastest of `repeats` runs after a warm-up."""

from __future__ import annotations

import io
import random
import time
from typing import Any

import numpy as np

from services.capacity.profile_options import Log, ProfileOptions, torch_dtype

WORDS = ("image", "picture", "scene", "light", "colour", "shape", "detail", "object", "person", "street", "house")


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


def engine_for(adapter: Any, model: Any, options: ProfileOptions) -> Any:
    """An engine configured as a worker with default settings, with room for the largest measurement."""
    from services.worker.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
    from services.worker.engine.engine import Engine

    kv_bytes = 0  # CUDA: sized from free memory, as the worker does
    if not options.device.startswith("cuda"):
        from services.worker.engine.attention.kv_cache import KVShape

        per_token = KVShape.of(model).block_bytes(1, torch_dtype(options.dtype))
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
