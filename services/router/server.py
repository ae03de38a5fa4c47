"""The router service: the public `Generation` API (Generate, CountTokens).

Per request: intake and accounting (no GPU work), admission onto a worker that reserves the
request's KV blocks (its Generate stream, opened at once so text can prefill), the uncached
items sent to an encoder with that worker as destination, then tokens detokenized and streamed.
Every failure ends the stream with a status naming the problem; the worker call and the encode
task are cancelled on every exit path, which frees the worker's reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from services.common import grpc_server
from services.common.block_hash import MediaSpan
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.model_info import ModelInfo, load_model_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.telemetry import Telemetry
from services.router.accounting import Accounted
from services.router.admission import Admission, AdmissionSettings, Rejection, Reserved
from services.router.cluster_view import ClusterView
from services.router.config import RouterConfig
from services.router.encode_dispatch import EncodeDispatcher
from services.router.errors import RequestError, unavailable
from services.router.http_server import serve_router_http
from services.router.metrics import RouterMetrics
from services.router.output import Choices, TokenTexts
from services.router.placement import PrefixAffinity
from services.router.request_blocks import RequestBlocks
from services.router.request_prep import RequestPrep

log = logging.getLogger(__name__)
REFUSALS = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass
class StreamEnd:
    """How a worker stream ended: when the worker freed the request (its clock; 0 if unknown)."""

    released_at: float = 0.0


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        info: ModelInfo,
        config: RouterConfig,
        prep: RequestPrep,
        admission: Admission,
        dispatcher: EncodeDispatcher,
        metrics: RouterMetrics,
        dialer: Dialer,
        view: ClusterView,
        tenancy: Tenancy,
    ) -> None:
        self._info = info
        self._config = config
        self._prep = prep
        self._admission = admission
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._channels = channels
        self._token_texts = TokenTexts(info.adapter.tokenizer)

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=grpc_server.channel_options())
        return self._channels[address]

    async def CountTokens(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> generation_pb2.TokenCount:
        try:
            return await self.count_tokens(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def count_tokens(self, request: generation_pb2.GenerateRequest) -> generation_pb2.TokenCount:
        """CountTokens for any front end (gRPC, HTTP); raises RequestError."""
        return (await self._prep.prepare(request)).accounted.token_count()

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for response in self.generate_stream(request, context.time_remaining()):
                yield response
        except RequestError as exc:
            if exc.metadata:
                context.set_trailing_metadata(exc.metadata)
            await context.abort(exc.code, exc.message)

    async def generate_stream(self, request: generation_pb2.GenerateRequest, timeout_s: float | None):
        """Generate for any front end (gRPC, HTTP): the responses, or RequestError. Every request is counted
        in the metrics here, once. The deadline is `timeout_s` (None: none) capped by the request timeout;
        closing the generator or cancelling its task cancels the worker call and frees its blocks."""
        start = time.perf_counter()
        outcome = "ok"
        self._metrics.running.add(1)
        try:
            async for response in self._generate(request, timeout_s, start):
                yield response
        except RequestError as exc:
            outcome = exc.code.name.lower()
            if isinstance(exc, Rejection):
                self._metrics.rejections.add(1, {"reason": exc.reason})
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception:
            outcome = "internal"
            log.exception("request failed unexpectedly")
            raise
        finally:
            self._metrics.running.add(-1)
            self._metrics.requests.add(1, {"outcome": outcome})
            self._metrics.e2e_seconds.record(time.perf_counter() - start)

    @staticmethod
    def _request_blocks(accounted: Accounted, cache_salt: str) -> RequestBlocks:
        """The request's blocks and prefix hashes, hashed lazily per block size of the workers it is ranked on."""
        spans = [MediaSpan(r.mm_hash, r.offset, r.num_tokens) for r in accounted.refs]
        return RequestBlocks.for_prompt(accounted.token_ids, accounted.projected_tokens, spans, cache_salt, accounted.n)

    async def _open_worker(self, worker: str, request: worker_pb2.WorkerRequest, timeout: float):
        """Open the worker stream and wait for admission; None when the worker refuses or is down."""
        call = worker_pb2_grpc.WorkerStub(self.channel(worker)).Generate(request, timeout=timeout)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in REFUSALS:
                return None
            raise RequestError(exc.code(), f"worker {worker}: {exc.details()}") from exc
        if first is grpc.aio.EOF or not first.admitted:
            call.cancel()
            return None
        return Reserved(call, first.state_at)

    async def _generate(self, request: generation_pb2.GenerateRequest, timeout_s: float | None, start: float):
        prepared = await self._prep.prepare(request)
        accounted, sampling = prepared.accounted, prepared.sampling
        request_id = request.request_id or uuid.uuid4().hex
        timeout = min(self._config.request_timeout_s, timeout_s if timeout_s is not None else float("inf"))
        deadline = time.monotonic() + timeout
        worker_request = worker_pb2.WorkerRequest(
            request_id=request_id,
            token_ids=accounted.token_ids,
            media=accounted.refs,
            sampling=sampling,
            cache_salt=request.cache_salt,
            embedding_timeout_s=min(timeout, self._config.encode_timeout_s),
        )
        admitted = await self._admission.admit(
            self._request_blocks(accounted, request.cache_salt),
            lambda worker: self._open_worker(worker, worker_request, timeout),
            deadline,
        )
        self._metrics.queue_seconds.record(admitted.queue_s)
        call = admitted.handle
        encode = asyncio.create_task(
            self._dispatcher.encode(request_id, list(accounted.refs), accounted.item_data, admitted.worker, deadline)
        )
        encode.add_done_callback(lambda task: task.cancelled() or task.exception() is None or call.cancel())
        encode.add_done_callback(self._record_encode)
        end = StreamEnd()
        try:
            async for response in self._stream(call, request_id, accounted, sampling, admitted, encode, start, end):
                yield response
        finally:
            call.cancel()
            encode.cancel()
            self._admission.released(admitted.worker, admitted.blocks, end.released_at)

    def _record_encode(self, task: asyncio.Task) -> None:
        """Encode time of the items sent to encoders (the task may end after the last token)."""
        if not task.cancelled() and task.exception() is None and task.result() > 0:
            self._metrics.encode_seconds.record(task.result())

    async def _stream(
        self,
        call,
        request_id: str,
        accounted: Accounted,
        sampling: common_pb2.SamplingParams,
        admitted,
        encode: asyncio.Task,
        start: float,
        end: StreamEnd,
    ):
        choices = Choices(self._info.adapter.tokenizer, list(sampling.stop), sampling.n, self._token_texts)
        first_token_s, cached, last, prefill_s = 0.0, 0, 0.0, 0.0
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                now = time.perf_counter()
                if not first_token_s:
                    first_token_s, prefill_s, last = now - start, response.prefill_s, now
                    self._metrics.ttft_seconds.record(first_token_s)
                elif response.index == 0:  # inter-token latency of choice 0 (the others arrive alongside)
                    self._metrics.itl_seconds.record(now - last)
                    last = now
                if response.index == 0:
                    cached = response.cached_tokens
                end.released_at = response.state_at or end.released_at  # set on the worker's last message only
                chunk = choices.chunk(response)
                if chunk is not None:
                    yield generation_pb2.GenerateResponse(chunk=chunk)
                if choices.done:  # every choice finished, or ended here at a stop string
                    break
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if encode.done() and not encode.cancelled() and encode.exception() is not None:
                raise encode.exception() from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                raise unavailable(f"worker {admitted.worker} failed: {exc.code().name}: {exc.details()}") from exc
            raise RequestError(exc.code(), f"worker {admitted.worker}: {exc.details()}") from exc
        usage = generation_pb2.Usage(
            prompt_tokens=accounted.prompt_tokens,
            text_tokens=accounted.text_tokens,
            image_tokens=accounted.image_tokens,
            completion_tokens=sum(stream.completion_tokens for stream in choices.streams),
            cached_tokens=cached,
        )
        encode_s = encode.result() if encode.done() and not encode.cancelled() and not encode.exception() else 0.0
        timing = generation_pb2.Timing(
            queue_s=admitted.queue_s,
            encode_s=encode_s,
            prefill_s=prefill_s,
            first_token_s=first_token_s,
            total_s=time.perf_counter() - start,
        )
        ends = choices.ends()
        final = generation_pb2.Final(
            finish_reason=ends[0].finish_reason, usage=usage, timing=timing, request_id=request_id, choices=ends
        )
        yield generation_pb2.GenerateResponse(final=final)


def _count_lookup(metrics: RouterMetrics, queries: int, hits: int) -> None:
    metrics.cache_queries.add(queries)
    if hits:
        metrics.cache_hits.add(hits, {"tier": "redis"})


async def start_router(config: RouterConfig):
    """Serve the public API on config.host:config.port (no model weights are loaded here)."""
    info = load_model_info(config.model)
    telemetry = Telemetry("router", config.host, config.metrics_port)
    metrics = RouterMetrics.create(telemetry.meter)
    cache = EmbeddingCache(CacheSettings(config.redis_url, info.identity.revision, max_bytes=0))
    view = ClusterView(Registry(config.redis_url), info.identity.revision)
    await view.start()
    channels: dict[str, grpc.aio.Channel] = {}
    admission = Admission(
        view,
        PrefixAffinity(),
        AdmissionSettings(
            config.admission_queue_size,
            config.admission_max_wait_s,
            config.retry_after_ms,
            config.prefix_affinity_weight,
        ),
    )
    servicer = GenerationServicer(
        info,
        config,
        RequestPrep(info, config, metrics),
        admission,
        EncodeDispatcher(
            view,
            cache,
            lambda a: servicer.channel(a),
            config.encoder_addrs,
            on_lookup=lambda queries, hits: _count_lookup(metrics, queries, hits),
        ),
        metrics,
        channels,
    )
    binding = grpc_server.ServiceBinding(
        generation_pb2_grpc.add_GenerationServicer_to_server, servicer, "epd.v1.Generation"
    )
    stop_http = await serve_router_http(config, info, servicer, view, metrics)  # listening before gRPC is healthy
    running = await grpc_server.start_server(config.host, config.port, [binding])
    log.info("router serving on %s:%d", config.host, running.port)

    async def stop() -> None:
        await stop_http()
        await running.stop()
        await view.stop()
        for channel in channels.values():
            await channel.close()
        telemetry.shutdown()

    return stop
