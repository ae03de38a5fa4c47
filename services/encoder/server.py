"""The encoder service: `Encode` turns items into embeddings and pushes them to a worker.

The work itself is in `pipeline` (dedupe, cache, cluster-wide lock, process-pool decode,
cross-request batching) and `push` (gRPC or torch.distributed). This module maps outcomes to
gRPC statuses, and wires the parts, the registry heartbeat and the metrics together.

Invariants: a bad item fails its request with INVALID_ARGUMENT naming the item; overload is
RESOURCE_EXHAUSTED at once with `retry-after-ms` and `epd-overload` (`wait` or `full`, see `load`)
trailing metadata; a push that fails on both
transports is UNAVAILABLE naming the worker; past the request's deadline it is DEADLINE_EXCEEDED.
Nothing here waits without a bound; the server keeps serving after any single failure. On SIGTERM
(`RunningEncoder.drain`) it leaves the registry and refuses new calls with UNAVAILABLE (the router fails
over to another encoder) while the calls it holds finish, for up to the drain timeout.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from services.common import grpc_server, overload, tls
from services.common.drain import Drain
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.hashing import canonical_json
from services.common.media import MediaError, MediaLimits
from services.common.media_types import VideoLimits
from services.common.model_info import load_model_info
from services.common.priority import lower_priority
from services.common.registry import Heartbeat, Registry
from services.common.rpc.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.common.service_main import dtype_of
from services.common.telemetry import Telemetry
from services.common.tracing import tracer
from services.encoder.batcher import Batcher, BatcherClosed
from services.encoder.config import EncoderConfig
from services.encoder.inflight_lock import InflightLocks
from services.encoder.load import Admission, EncoderRates, Overloaded
from services.encoder.metrics import EncoderMetrics
from services.encoder.pipeline import Pipeline, PipelineParts
from services.encoder.preprocess_cache import PreprocessCache
from services.encoder.preprocess_pool import PreprocessPool, PreprocessSettings
from services.encoder.push import Channels, DistPush, Pusher, PushError
from services.encoder.video_items import VideoPath
from services.models.base import ModelAdapter
from services.models.vision_runner import VisionRunner

log = logging.getLogger(__name__)
DEFAULT_DEADLINE_S = 120.0


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, pipeline: Pipeline, pusher: Pusher, metrics: EncoderMetrics, transfer_timeout_s: float) -> None:
        self._pipeline = pipeline
        self._pusher = pusher
        self._metrics = metrics
        self._transfer_timeout_s = transfer_timeout_s
        self.drain = Drain()

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str) -> None:
        self._metrics.rejections.add(1, {"reason": reason})
        trace.get_current_span().set_attribute("epd.refusal.reason", reason)
        await context.abort(code, message)

    async def Encode(
        self,
        request: encoder_pb2.EncodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> encoder_pb2.EncodeResponse:
        if not self.drain.enter():
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "shutdown", "encoder is draining")
        try:
            with tracer().start_as_current_span("encode", kind=trace.SpanKind.SERVER) as span:
                span.set_attributes(
                    {
                        "epd.items": len(request.items),
                        "epd.encoder_tokens": sum(item.ref.num_tokens for item in request.items),
                        "epd.destination": request.destination,
                    }
                )
                response = await self._encode(request, context)
                span.set_attribute("epd.encoded", response.encoded)
                span.set_attribute("epd.cache_hits", response.cached)
                return response
        finally:
            self.drain.leave()

    async def _encode(
        self,
        request: encoder_pb2.EncodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> encoder_pb2.EncodeResponse:
        start = time.perf_counter()
        budget = _budget(request, context)
        try:
            outcomes = await asyncio.wait_for(self._pipeline.embed(request.items, budget, request.booked), budget)
        except Overloaded as exc:
            context.set_trailing_metadata(overload.trailing(exc.retry_after_ms, exc.kind))
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", str(exc))
        except MediaError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(exc))
        except TimeoutError:
            await self._fail(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "deadline",
                f"encoding {len(request.items)} item(s) took longer than {budget:.1f}s",
            )
        except BatcherClosed as exc:
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "shutdown", str(exc))
        stages = _slowest([o.stages for o in outcomes])
        if request.destination and outcomes:
            push_from = time.perf_counter()
            remaining = budget - (push_from - start)
            timeout = max(0.1, min(self._transfer_timeout_s, remaining))
            try:
                device = self._pusher.device  # the GPU for dist over NCCL: fresh embeddings go from there
                with tracer().start_as_current_span("embedding_push", kind=trace.SpanKind.CLIENT) as span:
                    embeddings = [o.for_device(device) for o in outcomes]
                    pushed = await self._pusher.push(request.destination, embeddings, timeout)
                    span.set_attributes(
                        {
                            "epd.push.bytes": pushed.bytes,
                            "epd.push.transport": pushed.transport,
                            "epd.push.fell_back": pushed.fell_back,
                            "epd.push.items": len(outcomes),
                        }
                    )
            except PushError as exc:
                await self._fail(context, grpc.StatusCode.UNAVAILABLE, "push", str(exc))
            stages.push_s = time.perf_counter() - push_from
        encoded = sum(1 for o in outcomes if o.source == "encoded")
        return encoder_pb2.EncodeResponse(
            encoded=encoded, cached=len(outcomes) - encoded, encode_s=time.perf_counter() - start, stages=stages
        )


def _slowest(times: list[dict[str, float]]) -> common_pb2.EncodeStages:
    """Per stage the slowest item's seconds (the items run side by side)."""
    stages = common_pb2.EncodeStages()
    for item in times:
        for name, seconds in item.items():
            setattr(stages, name, max(getattr(stages, name), seconds))
    return stages


def _budget(request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> float:
    """Seconds this request may take: the smaller of its own `deadline_s` and the RPC deadline."""
    limits = [DEFAULT_DEADLINE_S]
    if request.deadline_s > 0:
        limits.append(request.deadline_s)
    remaining = context.time_remaining()
    if remaining is not None:
        limits.append(remaining)
    return max(0.001, min(limits))


@dataclass
class RunningEncoder:
    """Everything `start_encoder` started, stopped in reverse order by `stop`."""

    server: grpc_server.RunningServer
    heartbeat: Heartbeat
    batcher: Batcher
    pipeline: Pipeline
    pool: PreprocessPool
    pusher: Pusher
    telemetry: Telemetry
    closers: tuple = ()
    in_flight: Drain = field(default_factory=Drain)  # the servicer's: Encode calls being served

    @property
    def port(self) -> int:
        return self.server.port

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM: leave the registry, refuse new calls, let the calls held finish (up to `timeout_s`)."""
        self.in_flight.start()
        await self.server.health.enter_graceful_shutdown()
        await self.heartbeat.stop()
        if not await self.in_flight.wait_idle(timeout_s):
            log.warning("drain: %d Encode call(s) still running after %.1fs", self.in_flight.in_flight, timeout_s)

    async def stop(self) -> None:
        await self.heartbeat.stop()
        await self.server.stop()
        await self.batcher.close()
        await self.pusher.close()
        self.pipeline.close()
        self.pool.close(cancel_pending=True)
        for close in self.closers:
            close()
        self.telemetry.shutdown()


def _pusher(config: EncoderConfig, metrics: EncoderMetrics) -> Pusher:
    channels = Channels(tls.internal_client(config))
    dist = None
    if config.embedding_transport == "dist":
        if tls.internal_tls(config) is not None:
            log.warning("EPD_EMBEDDING_TRANSPORT=dist: embedding bytes move over %s without TLS", config.dist_backend)
        hostname = config.address.rpartition(":")[0] or config.host
        dist = DistPush(channels, config.dist_backend, hostname, config.transfer_timeout_s, device=config.device)
    return Pusher(config.embedding_transport, dist, channels, on_result=metrics.record_push)


def _video_path(config: EncoderConfig, adapter: ModelAdapter, metrics: EncoderMetrics) -> VideoPath:
    """The video path's settings: the router applies the frame and duration policy from the header; the
    encoder re-reads the header with the pixel cap and a generous frame bound, and bounds decoding by time."""
    limits = VideoLimits(config.max_video_frame_pixels, max_frames=1_000_000, max_seconds=86_400.0)
    cache = PreprocessCache(config.preprocess_cache_bytes, on_event=metrics.preprocess_cache_event)
    return VideoPath(canonical_json(adapter.processor_settings()), limits, config.video_decode_timeout_s, cache)


WARM_UP_IMAGE = (448, 448)
"""The warm-up's image: a common request size, whose measured cost seeds the drain rate (`EncoderRates`)."""


async def _warm_up(runner: VisionRunner, batcher: Batcher, pool: PreprocessPool, settings: PreprocessSettings) -> float:
    """One `WARM_UP_IMAGE` JPEG through decode, prepare and the tower, on their own processes and threads, before
    serving (first-call costs paid), then again, timed: returns the second's seconds, one item's cost on this
    host (what the encoder publishes as its rate until it has measured items of its own)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.radial_gradient("L").resize(WARM_UP_IMAGE).convert("RGB").save(buffer, format="JPEG")
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        decoded = await asyncio.wrap_future(pool.submit(buffer.getvalue(), settings))
        inputs = await asyncio.to_thread(runner.prepare, decoded.image())
        await batcher.warm_up([inputs])
        seconds = time.perf_counter() - start
    return seconds


async def start_encoder(config: EncoderConfig) -> RunningEncoder:
    """Load the model, start the pool, batcher and heartbeat, and serve `Encoder`."""
    info = load_model_info(config.model)
    model = info.adapter.load_model(device=config.device, dtype=dtype_of(config.dtype))
    telemetry = Telemetry("encoder", config.host, config.metrics_port, info.model_dir.resolve().name)
    telemetry.watch_loop()
    metrics = EncoderMetrics.create(telemetry.meter)
    cache = EmbeddingCache(
        CacheSettings.for_service(config, info.identity.revision),
        on_event=metrics.cache_event,
    )
    runner = VisionRunner(info.adapter, model)
    pool = PreprocessPool(config.workers, config.queue, nice=config.compute_nice)
    await asyncio.to_thread(pool.warm_up)
    batcher = Batcher(
        runner.encode_items,
        config.max_encoder_tokens_per_batch,
        config.max_batch_wait_ms / 1000,
        on_batch=metrics.record_batch,
        thread_initializer=functools.partial(lower_priority, config.compute_nice),
    )
    batcher.start()
    settings = PreprocessSettings(MediaLimits(max_pixels=config.max_image_pixels))
    item_s = await _warm_up(runner, batcher, pool, settings)
    item_tokens = info.adapter.image_tokens(*WARM_UP_IMAGE).num_tokens
    rates = EncoderRates(item_s=item_s, item_tokens=item_tokens)
    admission = Admission(pool, batcher, config.queued_token_cap, config.encoder_max_queue_s, rates)
    locks = InflightLocks(config.redis_url, info.identity.revision, cache.key, ttl_s=config.inflight_lock_ttl_s)
    pipeline = Pipeline(
        PipelineParts(
            info.adapter,
            runner,
            batcher,
            cache,
            locks,
            admission,
            metrics,
            settings,
            _video_path(config, info.adapter, metrics),
        ),
        cpu_threads=config.workers,
        nice=config.compute_nice,
    )
    pusher = _pusher(config, metrics)
    metrics.observe_load(admission.snapshot)
    servicer = EncoderServicer(pipeline, pusher, metrics, config.transfer_timeout_s)
    binding = grpc_server.ServiceBinding(encoder_pb2_grpc.add_EncoderServicer_to_server, servicer, "epd.v1.Encoder")
    running = await grpc_server.start_server(
        config.host,
        config.port,
        [binding],
        tls.internal_server_credentials(config),
        serving=False,
        health_port=config.health_port,
    )
    address = config.advertise_addr or f"{config.host}:{running.port}"
    registry = Registry(config.redis_url, ttl_s=max(1.0, 5 * config.heartbeat_interval_s))
    heartbeat = Heartbeat(
        registry,
        "encoder",
        address,
        info.identity.revision,
        lambda: admission.snapshot().as_state(),
        config.heartbeat_interval_s,
    )
    await heartbeat.start()
    await running.set_serving([binding.name])  # healthy once routers can find it
    log.info(
        "encoder serving on %s (model %s, %d decode processes, queue %d, transport %s, %.0f ms per warm-up item"
        " of %d tokens)",
        address,
        info.model_dir,
        config.workers,
        config.queue,
        config.embedding_transport,
        1000 * item_s,
        item_tokens,
    )
    return RunningEncoder(
        running,
        heartbeat,
        batcher,
        pipeline,
        pool,
        pusher,
        telemetry,
        (cache.close, locks.close, registry.close),
        in_flight=servicer.drain,
    )
