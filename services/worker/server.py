"""The worker service: token ids and media refs in, tokens streamed out.

A request enters the engine at once; a task per media item fetches its embedding (pushed or
cached) and hands it to the engine, which schedules media positions only once present. A
cancelled or failed stream aborts the request in the engine, which frees what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common import grpc_server
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.model_info import load_model_info
from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.common.service_main import dtype_of
from services.common.telemetry import Telemetry
from services.common.transport_grpc import ChunkAssembler, StreamError
from services.worker.config import WorkerConfig
from services.worker.embedding_store import EmbeddingStore
from services.worker.engine_loop import EngineLoop
from services.worker.simple_engine import (
    EngineRequest,
    MediaInput,
    SamplingOptions,
    SimpleEngine,
)

log = logging.getLogger(__name__)


def engine_request(request: worker_pb2.WorkerRequest) -> EngineRequest:
    sampling = request.sampling
    return EngineRequest(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        media=[MediaInput(m.mm_hash, m.offset, m.num_tokens, tuple(m.grid_thw)) for m in request.media],
        sampling=SamplingOptions(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else None,
            ignore_eos=sampling.ignore_eos,
        ),
        cache_salt=request.cache_salt,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, store: EmbeddingStore, config: WorkerConfig) -> None:
        self._loop = loop
        self._store = store
        self._config = config

    async def Generate(self, request: worker_pb2.WorkerRequest, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        outputs: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        self._loop.add_request(engine_request(request),
                               lambda out: event_loop.call_soon_threadsafe(outputs.put_nowait, out))
        timeout = request.embedding_timeout_s or self._config.embedding_timeout_s
        fetchers = [asyncio.create_task(self._fetch(m.mm_hash, timeout)) for m in request.media]
        fetch_error = asyncio.create_task(self._first_error(fetchers))
        finished = False
        try:
            while True:
                getter = asyncio.create_task(outputs.get())
                done, _ = await asyncio.wait({getter, fetch_error}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, fetch_error.result())
                out = getter.result()
                if out is None:
                    await context.abort(grpc.StatusCode.INTERNAL, "engine step failed; see worker log")
                finished = out.finished
                yield worker_pb2.WorkerResponse(
                    token_ids=out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason or "",
                    cached_tokens=out.cached_tokens, prefill_s=time.perf_counter() - start)
                if finished:
                    return
        finally:
            fetch_error.cancel()
            for task in fetchers:
                task.cancel()
            if not finished:
                self._loop.abort(request.request_id)

    async def _fetch(self, mm_hash: str, timeout_s: float) -> None:
        tensor = await self._store.fetch(mm_hash, timeout_s)
        self._loop.provide_embedding(mm_hash, tensor)

    @staticmethod
    async def _first_error(tasks: list[asyncio.Task]) -> str:
        """Resolve with a message when a fetch fails; wait forever if all succeed."""
        for task in asyncio.as_completed(tasks):
            try:
                await task
            except TimeoutError as exc:
                return str(exc)
        await asyncio.Event().wait()
        return ""

    async def PushEmbeddings(self, request_iterator, context: grpc.aio.ServicerContext) -> worker_pb2.PushAck:
        assembler = ChunkAssembler()
        items = 0
        try:
            async for chunk in request_iterator:
                embedding = assembler.add(chunk)
                if embedding is not None:
                    self._store.put(embedding.mm_hash, embedding.tensor)
                    items += 1
            assembler.finish()
        except (StreamError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad embedding stream: {exc}")
        return worker_pb2.PushAck(items=items, bytes=assembler.total_bytes)

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext,
                    ) -> worker_pb2.AbortReply:
        self._loop.abort(request.request_id)
        return worker_pb2.AbortReply(found=True)


async def start_worker(config: WorkerConfig) -> tuple[grpc_server.RunningServer, EngineLoop]:
    """Load the model, start the engine thread and serve `Worker` on config.host:config.port."""
    info = load_model_info(config.model)
    model = info.adapter.load_model(device=config.device, dtype=dtype_of(config.dtype))
    telemetry = Telemetry("worker", config.host, config.metrics_port)
    cache = EmbeddingCache(CacheSettings(config.redis_url, info.identity.revision,
                                         max_bytes=config.embedding_cache_bytes,
                                         ttl_s=config.embedding_cache_ttl_s))
    loop = EngineLoop(SimpleEngine(info.adapter, model))
    loop.start()
    servicer = WorkerServicer(loop, EmbeddingStore(cache), config)
    binding = grpc_server.ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, servicer,
                                         "epd.v1.Worker")
    running = await grpc_server.start_server(config.host, config.port, [binding])
    log.info("worker serving on %s:%d (model %s)", config.host, running.port, info.model_dir)
    del telemetry  # kept alive by its HTTP server thread; nothing else needs it yet
    return running, loop
