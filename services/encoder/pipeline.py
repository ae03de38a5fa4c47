"""From `EncodeItem`s to embeddings: dedupe, cache, cluster-wide lock, decode, batch, cache write.

Per request: items whose `mm_hash` is already in flight on this encoder join that work; the rest
are admitted together (all or none, before any I/O: a refusal is immediate). Then per item: the
cache; else the cluster-wide lock (or wait for the encoder holding it); else decode in the
process pool, prepare the model inputs on a thread, encode in a cross-request batch, write the
cache, release the lock. Videos take `video_items` for the middle part: the router's frame plan, the
preprocessing cache, and the tower in chunks of temporal patches.

Invariants:
- On one encoder, an `mm_hash` has at most one producing task (`_inflight`); later callers await
  its shielded future, so a cancelled caller never cancels the work others wait for.
- An embedding is written to the cache before its lock is released, so an encoder waiting on the
  lock finds it; the lock is released on every path.
- An encoded embedding stays on the model's device (`ItemEmbedding`); the cache write, on an I/O thread,
  makes its batch's one host copy. `ItemOutcome.for_device` gives a push the device tensor when the
  transport sends from that device (torch.distributed over NCCL), else the host copy.
- Every admitted item's slot and tokens are given back exactly once (`Ticket.finish` in finally).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from services.common.embedding_cache import EmbeddingCache
from services.common.media import MediaError, MediaReason
from services.common.priority import lower_priority
from services.common.rpc.epd.v1 import encoder_pb2
from services.common.tracing import StageSpans
from services.common.transport_grpc import Embedding
from services.encoder.batcher import Batcher, BatchItem
from services.encoder.inflight_lock import InflightLocks
from services.encoder.load import Admission, Ticket
from services.encoder.metrics import EncoderMetrics
from services.encoder.preprocess_pool import PreprocessSettings
from services.encoder.video_items import VideoPath, encode_video, prepare_video
from services.models.base import ModelAdapter, supports_video
from services.models.vision_runner import ItemEmbedding, VisionRunner

T = TypeVar("T")
_PEER_POLL_S = (0.005, 0.1)  # first and longest wait between looks at another encoder's progress


@dataclass(frozen=True)
class ItemOutcome:
    """An item's embedding and where it came from: encoded | cache | joined | peer; `stages` is where an
    encoded item's time went (`EncodeStages`' fields, seconds; empty otherwise)."""

    mm_hash: str
    embedding: ItemEmbedding
    source: str
    stages: dict[str, float] = field(default_factory=dict)

    def for_device(self, device: torch.device) -> Embedding:
        """The embedding as a transport sending from `device` takes it (see `ItemEmbedding.for_device`)."""
        return Embedding(self.mm_hash, self.embedding.for_device(device))


@dataclass(frozen=True)
class PipelineParts:
    """What the pipeline drives; all owned by the encoder server."""

    adapter: ModelAdapter
    runner: VisionRunner
    batcher: Batcher
    cache: EmbeddingCache
    locks: InflightLocks
    admission: Admission
    metrics: EncoderMetrics
    settings: PreprocessSettings
    video: VideoPath | None = None  # None: video items are refused


class Pipeline:
    """See the module docstring. Call `embed` on the event loop."""

    def __init__(self, parts: PipelineParts, io_threads: int = 8, cpu_threads: int = 2, nice: int = 0) -> None:
        self._parts = parts
        self._inflight: dict[str, asyncio.Future[ItemOutcome]] = {}
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="encoder-io")
        self._cpu = ThreadPoolExecutor(
            cpu_threads, thread_name_prefix="encoder-prepare", initializer=functools.partial(lower_priority, nice)
        )

    async def embed(
        self, items: Sequence[encoder_pb2.EncodeItem], budget_s: float | None = None, booked: bool = False
    ) -> list[ItemOutcome]:
        """Embeddings for `items` in order, admitted when expected within `budget_s` (and, unless `booked`, the
        encoder's time budget: `Admission.admit`). Raises Overloaded (nothing started), MediaError, or what
        encoding raised."""
        hashes = [item.ref.mm_hash for item in items]
        new: dict[str, int] = {}  # mm_hash -> first index, for items nobody here is producing yet
        for index, mm_hash in enumerate(hashes):
            if mm_hash not in self._inflight and mm_hash not in new:
                new[mm_hash] = index
        tokens = [max(1, items[i].ref.num_tokens) for i in new.values()]
        ticket = self._parts.admission.admit(tokens, budget_s, booked)
        loop = asyncio.get_running_loop()
        for slot, (mm_hash, index) in enumerate(new.items()):
            task = loop.create_task(self._produce(slot, index, items[index], ticket))
            self._inflight[mm_hash] = task
            task.add_done_callback(lambda done, key=mm_hash: self._settle(key, done))
        futures = [self._inflight[mm_hash] for mm_hash in hashes]
        results = await asyncio.gather(*(asyncio.shield(future) for future in futures))
        return [
            result if new.get(mm_hash) == index else ItemOutcome(mm_hash, result.embedding, "joined")
            for index, (mm_hash, result) in enumerate(zip(hashes, results, strict=True))
        ]

    def _settle(self, mm_hash: str, task: asyncio.Future[ItemOutcome]) -> None:
        if self._inflight.get(mm_hash) is task:
            del self._inflight[mm_hash]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter re-raises it itself

    async def _produce(self, slot: int, index: int, item: encoder_pb2.EncodeItem, ticket: Ticket) -> ItemOutcome:
        mm_hash = item.ref.mm_hash
        parts = self._parts
        encoded = False
        try:
            lookup = await self._off(self._io, parts.cache.get, mm_hash)
            if lookup.tensor is not None:
                return ItemOutcome(mm_hash, ItemEmbedding.from_host(lookup.tensor), "cache")
            while True:
                if await self._off(self._io, parts.locks.acquire, mm_hash):
                    stages: dict[str, float] = {}
                    try:
                        embedding = await self._encode(slot, index, item, ticket, stages)
                    finally:
                        await self._off(self._io, parts.locks.release, mm_hash)
                    encoded = True
                    return ItemOutcome(mm_hash, embedding, "encoded", stages)
                parts.metrics.peer_waits.add(1)
                with ticket.waiting_for_peer():
                    tensor = await self._wait_for_peer(mm_hash)
                if tensor is not None:
                    return ItemOutcome(mm_hash, ItemEmbedding.from_host(tensor), "peer")
        finally:
            ticket.finish(slot, encoded, sample=item.ref.modality != "video")

    async def _encode(
        self, slot: int, index: int, item: encoder_pb2.EncodeItem, ticket: Ticket, times: dict[str, float]
    ) -> ItemEmbedding:
        """Decode, prepare, tower, cache write; `times` gets each stage's seconds (`EncodeStages`' names)."""
        if item.ref.modality == "video":
            return await self._encode_video(slot, index, item, ticket, times)
        parts = self._parts
        stages = StageSpans()  # encode.preprocess, encode.tower under the Encode call's span
        decoded = await asyncio.wrap_future(ticket.use_slot(slot).submit(item.data, parts.settings, index=index))
        image = decoded.image()
        start = time.perf_counter()
        inputs = await self._off(self._cpu, parts.runner.prepare, image)
        prepared = time.perf_counter()
        times.update(decode_queue_s=decoded.queue_s, decode_s=decoded.decode_s, prepare_s=prepared - start)
        parts.metrics.preprocess_seconds.record(decoded.decode_s + prepared - start)
        tokens = parts.adapter.image_tokens(image.width, image.height).num_tokens
        stages.mark("encode.preprocess", {"epd.decode_s": decoded.decode_s, "epd.encoder_tokens": tokens})
        if item.ref.num_tokens and item.ref.num_tokens != tokens:
            raise MediaError(
                f"the router counted {item.ref.num_tokens} tokens for this image, the encoder "
                f"{tokens} (do both run the same model revision?)",
                MediaReason.CORRUPT,
                index=index,
            )
        tower_from = time.perf_counter()
        embedding: ItemEmbedding = await parts.batcher.submit(BatchItem(item.ref.mm_hash, tokens, inputs))
        stages.mark("encode.tower", {"epd.encoder_tokens": tokens})  # waiting for a tower call, and the call
        await self._written(item.ref.mm_hash, embedding, times, tower_from)
        return embedding

    async def _written(self, mm_hash: str, embedding: ItemEmbedding, times: dict[str, float], since: float) -> None:
        """Write the cache; `times` gets the tower's seconds (since `since`) and the write's."""
        written_from = time.perf_counter()
        times["tower_s"] = written_from - since
        await self._off(self._io, self._cache_write, mm_hash, embedding)
        times["cache_write_s"] = time.perf_counter() - written_from

    async def _encode_video(
        self, slot: int, index: int, item: encoder_pb2.EncodeItem, ticket: Ticket, times: dict[str, float]
    ) -> ItemEmbedding:
        parts = self._parts
        if parts.video is None or not supports_video(parts.adapter):
            raise MediaError("this encoder's model takes no video", MediaReason.FORMAT, index=index, media="video")
        stages = StageSpans()  # encode.preprocess (decode or preprocessing-cache hit), encode.tower, as for images
        prepared = await prepare_video(
            parts.adapter,
            parts.video,
            item,
            index,
            lambda: ticket.use_slot(slot),
            lambda fn, *args: self._off(self._cpu, fn, *args),
        )
        parts.metrics.preprocess_seconds.record(prepared.seconds)
        times["prepare_s"] = prepared.seconds  # decode or a preprocessing-cache hit, and the frames' preparation
        video = {"epd.modality": "video", "epd.encoder_tokens": item.ref.num_tokens}
        stages.mark(
            "encode.preprocess",
            {**video, "epd.frames": len(item.ref.frame_indices), "epd.frames_from": prepared.source},
        )
        tower_from = time.perf_counter()
        embedding = await encode_video(parts.batcher, item.ref.mm_hash, prepared.inputs, item.ref.num_tokens)
        stages.mark("encode.tower", video)  # waiting for the tower calls of its chunks, and the calls
        await self._written(item.ref.mm_hash, embedding, times, tower_from)
        return embedding

    def _cache_write(self, mm_hash: str, embedding: ItemEmbedding) -> None:
        """Write the host copy (made here, off the event loop, once per batch) to the cache."""
        self._parts.cache.put(mm_hash, embedding.host())

    async def _wait_for_peer(self, mm_hash: str) -> Any:
        """The embedding another encoder is producing, or None once its lock is gone without one.

        Bounded: the other encoder's lock expires by its TTL, after which this returns None.
        """
        parts = self._parts
        delay = _PEER_POLL_S[0]
        while True:
            state = await self._off(self._io, parts.locks.peer_state, mm_hash)
            if state.cached:
                lookup = await self._off(self._io, parts.cache.get, mm_hash)
                if lookup.tensor is not None:
                    return lookup.tensor
            if not state.locked:
                return None
            await asyncio.sleep(delay)
            delay = min(_PEER_POLL_S[1], delay * 2)

    @staticmethod
    async def _off(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        self._cpu.shutdown(wait=False, cancel_futures=True)
