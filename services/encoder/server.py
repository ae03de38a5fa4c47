"""The encoder service: `Encode` decodes items, runs the vision tower, pushes embeddings to a worker.

Invariants: the same `mm_hash` in flight twice is encoded once (later callers await the first);
every embedding produced is written to the cache; a bad item fails its request with
INVALID_ARGUMENT naming the item and leaves the server serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from services.common import grpc_server
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.media import MediaError, MediaLimits
from services.common.model_info import ModelInfo, load_model_info
from services.common.rpc.epd.v1 import encoder_pb2, encoder_pb2_grpc, worker_pb2_grpc
from services.common.service_main import dtype_of
from services.common.telemetry import Telemetry
from services.common.transport_grpc import Embedding, iter_chunks
from services.encoder.config import EncoderConfig
from services.encoder.metrics import EncoderMetrics
from services.encoder.preprocess import load_image
from services.encoder.runner import VisionRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemResult:
    embedding: Embedding
    encoded: bool  # False when it came from the cache or another request's encode


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, info: ModelInfo, runner: VisionRunner, cache: EmbeddingCache,
                 metrics: EncoderMetrics, limits: MediaLimits) -> None:
        self._info = info
        self._runner = runner
        self._cache = cache
        self._metrics = metrics
        self._limits = limits
        self._inflight: dict[str, asyncio.Future[Embedding]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext,
                     ) -> encoder_pb2.EncodeResponse:
        start = time.perf_counter()
        try:
            results = await asyncio.gather(
                *(self._embedding_for(index, item) for index, item in enumerate(request.items)))
        except MediaError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.destination:
            await self._push(request.destination, [r.embedding for r in results], context)
        encoded = sum(1 for r in results if r.encoded)
        return encoder_pb2.EncodeResponse(encoded=encoded, cached=len(results) - encoded,
                                          encode_s=time.perf_counter() - start)

    async def _embedding_for(self, index: int, item: encoder_pb2.EncodeItem) -> ItemResult:
        mm_hash = item.ref.mm_hash
        pending = self._inflight.get(mm_hash)
        if pending is not None:
            return ItemResult(await asyncio.shield(pending), encoded=False)
        lookup = await asyncio.to_thread(self._cache.get, mm_hash)
        if lookup.tensor is not None:
            return ItemResult(Embedding(mm_hash, lookup.tensor), encoded=False)
        pending = self._inflight.get(mm_hash)  # another request may have started it meanwhile
        if pending is not None:
            return ItemResult(await asyncio.shield(pending), encoded=False)
        future: asyncio.Future[Embedding] = asyncio.get_running_loop().create_future()
        self._inflight[mm_hash] = future
        try:
            embedding = await asyncio.to_thread(self._encode_one, index, mm_hash, item.data)
            future.set_result(embedding)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._inflight.pop(mm_hash, None)
        return ItemResult(embedding, encoded=True)

    def _encode_one(self, index: int, mm_hash: str, data: bytes) -> Embedding:
        start = time.perf_counter()
        try:
            image = load_image(data, self._limits)
        except MediaError as exc:
            raise exc.with_index(index) from exc
        self._metrics.preprocess_seconds.record(time.perf_counter() - start)
        batch = self._runner.encode([image])
        self._metrics.encode_seconds.record(batch.seconds)
        self._metrics.batch_size.record(1)
        self._metrics.items_encoded.add(1)
        tensor = batch.embeddings[0]
        self._cache.put(mm_hash, tensor)
        return Embedding(mm_hash, tensor)

    async def _push(self, destination: str, embeddings: list[Embedding],
                    context: grpc.aio.ServicerContext) -> None:
        channel = self._channels.get(destination)
        if channel is None:
            channel = grpc.aio.insecure_channel(destination, options=grpc_server.channel_options())
            self._channels[destination] = channel
        stub = worker_pb2_grpc.WorkerStub(channel)
        start = time.perf_counter()
        try:
            ack = await stub.PushEmbeddings(iter_chunks(embeddings), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"pushing embeddings to worker {destination} failed: {exc.details()}")
        self._metrics.transfer_bytes.add(ack.bytes, {"transport": "grpc"})
        self._metrics.transfer_seconds.record(time.perf_counter() - start, {"transport": "grpc"})

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def start_encoder(config: EncoderConfig) -> grpc_server.RunningServer:
    """Load the model and serve `Encoder` on config.host:config.port; returns the running server."""
    info = load_model_info(config.model)
    model = info.adapter.load_model(device=config.device, dtype=dtype_of(config.dtype))
    telemetry = Telemetry("encoder", config.host, config.metrics_port)
    metrics = EncoderMetrics.create(telemetry.meter)
    cache = EmbeddingCache(
        CacheSettings(config.redis_url, info.identity.revision, max_bytes=config.embedding_cache_bytes,
                      ttl_s=config.embedding_cache_ttl_s),
        on_event=metrics.cache_event,
    )
    servicer = EncoderServicer(info, VisionRunner(info.adapter, model), cache, metrics,
                               MediaLimits(max_pixels=config.max_image_pixels))
    binding = grpc_server.ServiceBinding(encoder_pb2_grpc.add_EncoderServicer_to_server, servicer,
                                         "epd.v1.Encoder")
    running = await grpc_server.start_server(config.host, config.port, [binding])
    log.info("encoder serving on %s:%d (model %s)", config.host, running.port, info.model_dir)
    return running
