"""Benchmark: a video's preprocessing with the encoder's preprocessing cache missing versus hitting.

One video through the encoder's own path (`services.encoder.video_items.prepare_video`: the preprocessing
key, then a decode-and-resize job in a real pool child or the cached frames, then the model's normalise and
patchify): milliseconds per video on a miss and on a hit, and their ratio. Part of `epd bench encoder`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from services.common.hashing import canonical_json
from services.common.media_types import VideoLimits
from services.common.model_info import load_model_info
from services.common.rpc.epd.v1 import common_pb2, encoder_pb2
from services.common.video import probe_video
from services.encoder.preprocess_cache import PreprocessCache
from services.encoder.preprocess_pool import PreprocessPool
from services.encoder.video_items import VideoPath, prepare_video
from tests import media_factory


def bench_video_preprocess(model_dir: Path, quick: bool, repeats: int = 5) -> dict[str, Any]:
    """Per-video preprocessing milliseconds on a cache miss and on a hit (medians over `repeats`)."""
    width, height, seconds, fps = (320, 240, 4, 30) if quick else (640, 360, 10, 30)
    data = media_factory.video(width, height, seconds=seconds, fps=fps)
    adapter = load_model_info(model_dir).adapter
    header = probe_video(data, VideoLimits())
    tokens = adapter.video_tokens(header.width, header.height, header.frames, header.fps)
    ref = common_pb2.MediaRef(
        mm_hash="bench",
        modality="video",
        num_tokens=tokens.num_tokens,
        grid_thw=list(tokens.grid_thw),
        frame_indices=list(tokens.frame_indices),
    )
    item = encoder_pb2.EncodeItem(ref=ref, data=data)
    with PreprocessPool(1, 4) as pool:
        pool.warm_up()
        miss, hit = asyncio.run(_timed(adapter, pool, item, repeats))
    return {
        "video": f"{width}x{height} {seconds}s {fps}fps, {len(tokens.frame_indices)} frames sampled",
        "video_tokens": tokens.num_tokens,
        "video_preprocess_miss_ms": miss,
        "video_preprocess_hit_ms": hit,
        "video_preprocess_miss_over_hit": miss / hit,
    }


async def _timed(adapter: Any, pool: PreprocessPool, item: encoder_pb2.EncodeItem, repeats: int) -> tuple[float, float]:
    loop = asyncio.get_running_loop()

    def off_thread(fn: Any, *args: Any) -> Any:
        return loop.run_in_executor(None, fn, *args)

    settings_json = canonical_json(adapter.processor_settings())
    misses, hits = [], []
    for _ in range(repeats + 1):  # the first round warms the child's torch import up
        cache = PreprocessCache(1 << 30)
        path = VideoPath(settings_json, VideoLimits(), 60.0, cache)
        for into in (misses, hits):
            start = time.perf_counter()
            await prepare_video(adapter, path, item, 0, lambda: pool.reserve(1), off_thread)
            into.append(1000 * (time.perf_counter() - start))
    return statistics.median(misses[1:]), statistics.median(hits[1:])
