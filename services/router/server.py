"""The router service: the public `Generation` API (Generate, CountTokens).

Per request: intake and accounting (no GPU work), a worker stream opened at once so text can
prefill, the uncached items sent to an encoder with that worker as destination, then tokens
detokenized and streamed to the client. Any failure ends the stream with a status naming the
problem; the worker call and the encode call are cancelled on every exit path.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import grpc

from services.common import grpc_server
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.media import MediaLimits
from services.common.model_info import ModelInfo, load_model_info
from services.common.rpc.epd.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.router.accounting import Accounted, account
from services.router.config import RouterConfig
from services.router.errors import RequestError, invalid, unavailable
from services.router.intake import IntakeLimits, parse_messages
from services.router.output import Detokenizer

log = logging.getLogger(__name__)


def validate_sampling(sampling: common_pb2.SamplingParams, default_max_tokens: int) -> common_pb2.SamplingParams:
    """A copy with defaults filled; INVALID_ARGUMENT for values out of range."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    if out.max_tokens == 0:
        out.max_tokens = default_max_tokens
    if out.temperature < 0:
        raise invalid(f"sampling.temperature must be >= 0, got {out.temperature}")
    if not 0 <= out.top_p <= 1:
        raise invalid(f"sampling.top_p must be in [0, 1], got {out.top_p}")
    return out


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, info: ModelInfo, config: RouterConfig, cache: EmbeddingCache) -> None:
        self._info = info
        self._config = config
        self._cache = cache
        self._limits = IntakeLimits(config.max_images_per_prompt, config.max_item_bytes,
                                    config.max_request_bytes, MediaLimits(max_pixels=config.max_image_pixels))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._workers = itertools.cycle(config.worker_addrs)
        self._encoders = itertools.cycle(config.encoder_addrs)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=grpc_server.channel_options())
        return self._channels[address]

    def _prepare(self, request: generation_pb2.GenerateRequest) -> Accounted:
        sampling = validate_sampling(request.sampling, self._config.default_max_tokens)
        intake = parse_messages(list(request.messages), self._limits)
        return account(self._info, intake, sampling.max_tokens)

    async def CountTokens(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                          ) -> generation_pb2.TokenCount:
        try:
            return (await asyncio.to_thread(self._prepare, request)).token_count()
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for response in self._generate(request, context):
                yield response
        except RequestError as exc:
            if exc.metadata:
                context.set_trailing_metadata(exc.metadata)
            await context.abort(exc.code, exc.message)

    async def _generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        accounted = await asyncio.to_thread(self._prepare, request)
        sampling = validate_sampling(request.sampling, self._config.default_max_tokens)
        remaining = context.time_remaining()
        timeout = min(self._config.request_timeout_s, remaining if remaining is not None else float("inf"))
        worker = next(self._workers)
        call = worker_pb2_grpc.WorkerStub(self._channel(worker)).Generate(
            worker_pb2.WorkerRequest(request_id=request_id, token_ids=accounted.token_ids, media=accounted.refs,
                                     sampling=sampling, cache_salt=request.cache_salt,
                                     embedding_timeout_s=min(timeout, self._config.encode_timeout_s)),
            timeout=timeout)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._worker_error(worker, exc) from exc
        if first is grpc.aio.EOF or not first.admitted:
            raise unavailable(f"worker {worker} ended the stream before admitting the request")
        encode = asyncio.create_task(self._encode(request_id, accounted, worker, timeout))
        encode.add_done_callback(lambda task: task.cancelled() or task.exception() is None or call.cancel())
        detok = Detokenizer(self._info.adapter.tokenizer, list(sampling.stop))
        completion, first_token_s, reason, cached = 0, 0.0, "length", 0
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                completion += len(response.token_ids)
                first_token_s = first_token_s or time.perf_counter() - start
                delta = detok.add(list(response.token_ids))
                text = delta.text + (detok.flush() if response.finished and not delta.stopped else "")
                yield generation_pb2.GenerateResponse(
                    chunk=generation_pb2.Chunk(token_ids=response.token_ids, text=text))
                if delta.stopped or response.finished:
                    reason = "stop" if delta.stopped else response.finish_reason
                    cached = response.cached_tokens
                    break
        except grpc.aio.AioRpcError as exc:
            if encode.done() and not encode.cancelled() and encode.exception() is not None:
                raise encode.exception() from exc
            raise self._worker_error(worker, exc) from exc
        except asyncio.CancelledError:
            if encode.done() and not encode.cancelled() and encode.exception() is not None:
                raise encode.exception() from None
            raise
        finally:
            call.cancel()
            encode.cancel()
        encode_s = encode.result() if encode.done() and not encode.cancelled() else 0.0
        usage = generation_pb2.Usage(
            prompt_tokens=accounted.prompt_tokens, text_tokens=accounted.text_tokens,
            image_tokens=accounted.image_tokens, completion_tokens=completion, cached_tokens=cached)
        timing = generation_pb2.Timing(encode_s=encode_s, first_token_s=first_token_s,
                                       total_s=time.perf_counter() - start)
        yield generation_pb2.GenerateResponse(final=generation_pb2.Final(
            finish_reason=reason, usage=usage, timing=timing, request_id=request_id))

    async def _encode(self, request_id: str, accounted: Accounted, worker: str, timeout: float) -> float:
        """Send the items not in the shared cache to an encoder; returns seconds spent."""
        if not accounted.refs:
            return 0.0
        start = time.perf_counter()
        cached = await asyncio.to_thread(self._cached, [ref.mm_hash for ref in accounted.refs])
        items = [encoder_pb2.EncodeItem(ref=ref, data=data)
                 for ref, data, hit in zip(accounted.refs, accounted.item_data, cached, strict=True) if not hit]
        if not items:
            return 0.0
        encoder = next(self._encoders)
        try:
            await encoder_pb2_grpc.EncoderStub(self._channel(encoder)).Encode(
                encoder_pb2.EncodeRequest(request_id=request_id, items=items, destination=worker,
                                          deadline_s=timeout),
                timeout=min(timeout, self._config.encode_timeout_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(exc.details()) from exc
            raise unavailable(f"encoder {encoder} failed: {exc.code().name}: {exc.details()}") from exc
        return time.perf_counter() - start

    def _cached(self, hashes: list[str]) -> list[bool]:
        return [self._cache.contains(h) for h in hashes]

    @staticmethod
    def _worker_error(worker: str, exc: grpc.aio.AioRpcError) -> RequestError:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            return unavailable(f"worker {worker} failed: {code.name}: {exc.details()}")
        return RequestError(code, f"worker {worker}: {exc.details()}")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def start_router(config: RouterConfig) -> grpc_server.RunningServer:
    """Serve the public API on config.host:config.port (no model weights are loaded here)."""
    info = load_model_info(config.model)
    cache = EmbeddingCache(CacheSettings(config.redis_url, info.identity.revision, max_bytes=0))
    servicer = GenerationServicer(info, config, cache)
    binding = grpc_server.ServiceBinding(generation_pb2_grpc.add_GenerationServicer_to_server, servicer,
                                         "epd.v1.Generation")
    running = await grpc_server.start_server(config.host, config.port, [binding])
    log.info("router serving on %s:%d", config.host, running.port)
    return running
