"""The encoder's path for one video item: frame plan, preprocessing cache or pool decode, pixel inputs, tower.

The frames decoded are exactly the router's (`MediaRef.frame_indices`, sized by its `grid_thw`): the adapter
turns them into a `VideoFramePlan`, checked against the grid, and the pool child decodes those or refuses
(services/encoder/video_decode.py). Decoded, resized frames go through the preprocessing cache
(`preprocess_cache.py`).

Batching decision: a long video is split across tower calls rather than given the budget. Each chunk holds
whole temporal patches and at most half of the batcher's token budget (at least one patch), and the next
chunk is queued only once the previous one is done, so images arriving meanwhile ride in the same calls
(FIFO) and wait for at most one chunk, never for the whole video. Exact: the Qwen2-VL and Qwen3-VL towers attend
within one temporal patch (their attention sequences are per patch; Qwen3-VL's position grid is interpolated per
patch), so a chunk's rows equal the same rows of the whole video encoded at once (tested, DeepStack levels
included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.media import MediaError, MediaReason
from services.common.media_types import VideoLimits
from services.common.rpc.epd.v1 import encoder_pb2
from services.encoder.batcher import Batcher, BatchItem
from services.encoder.preprocess_cache import PreprocessCache, preprocess_key
from services.encoder.preprocess_pool import PoolReservation
from services.encoder.video_decode import video_job
from services.models.base import PixelInputs, VideoAdapter, VideoError
from services.models.vision_runner import ItemEmbedding, VisionOutput


@dataclass(frozen=True)
class VideoPath:
    """What the video path needs besides the item: the model's processor settings (canonical JSON, part of
    the preprocessing key), the decode limits and time bound, and the cache."""

    settings_json: str
    limits: VideoLimits
    timeout_s: float
    cache: PreprocessCache


@dataclass(frozen=True)
class PreparedVideo:
    """A video's pixel inputs, where its frames came from ("cache" or "decoded"), and the seconds spent."""

    inputs: PixelInputs
    source: str
    seconds: float


async def prepare_video(
    adapter: VideoAdapter,
    settings: VideoPath,
    item: encoder_pb2.EncodeItem,
    index: int,
    reservation: Callable[[], PoolReservation],
    off_thread: Callable[..., Awaitable[Any]],
) -> PreparedVideo:
    """Pixel inputs of `item`'s planned frames. `reservation()` hands the item's pool slot over (called only
    on a cache miss); `off_thread(fn, *args)` runs CPU work off the event loop. Raises MediaError."""
    ref, start = item.ref, time.perf_counter()
    grid = tuple(int(v) for v in ref.grid_thw)
    try:
        plan = adapter.video_frame_plan(grid, tuple(int(i) for i in ref.frame_indices))
    except VideoError as exc:
        raise MediaError(str(exc), MediaReason.CORRUPT, index=index, media="video") from None
    key = await off_thread(preprocess_key, settings.settings_json, plan, item.data)
    frames = settings.cache.get(key)
    source = "cache"
    if frames is None:
        job = reservation().submit_call(
            video_job, item.data, plan, settings.limits, settings.timeout_s, time.monotonic(), index
        )
        frames = (await asyncio.wrap_future(job)).frames
        settings.cache.put(key, frames)
        source = "decoded"
    inputs = await off_thread(adapter.preprocess_video, frames, grid)
    return PreparedVideo(inputs, source, time.perf_counter() - start)


def temporal_chunks(grid_thw: tuple[int, int, int], tokens: int, budget: int) -> list[tuple[int, int]]:
    """Temporal-patch ranges `[t0, t1)` covering the grid, each at most `budget // 2` of the item's `tokens`
    (at least one patch each)."""
    steps = grid_thw[0]
    per_step = max(1, tokens // max(1, steps))
    size = max(1, (budget // 2) // per_step)
    return [(t0, min(steps, t0 + size)) for t0 in range(0, steps, size)]


async def encode_video(batcher: Batcher, mm_hash: str, inputs: PixelInputs, tokens: int) -> ItemEmbedding:
    """The video's embedding through `batcher`, in `temporal_chunks` queued one after another."""
    t, h, w = inputs.grid_thw
    chunks = temporal_chunks(inputs.grid_thw, tokens, batcher.max_tokens)
    if len(chunks) == 1:
        return await batcher.submit(BatchItem(mm_hash, tokens, inputs))
    rows_per_step, tokens_per_step = h * w, tokens // t
    parts: list[ItemEmbedding] = []
    for t0, t1 in chunks:
        chunk = PixelInputs(inputs.pixel_values[t0 * rows_per_step : t1 * rows_per_step], (t1 - t0, h, w))
        item = BatchItem(f"{mm_hash}#t{t0}", (t1 - t0) * tokens_per_step, chunk)
        parts.append(await batcher.submit(item))
    return VisionOutput([torch.cat([part.tensor for part in parts])]).items()[0]
