"""The worker service: token ids and media refs in, tokens streamed out.

Generate admits first: reserve + add run as one engine-thread command, so concurrent callers
(several routers) can never over-admit; a refusal is RESOURCE_EXHAUSTED at once. Admitted
requests enter the engine immediately; a task per media item fetches its embedding (pushed or
cached) and hands it over, unless the engine still holds it from an earlier request
(services/worker/held_embeddings.py); the engine schedules media positions only once present. A
cancelled or failed stream aborts the request, which frees its blocks and reservation.
A request of `sampling.n` choices streams each response for one choice (`index`); the stream
ends once every choice finished. On SIGTERM the worker drains (`RunningWorker.drain`, worker/startup.py):
it leaves the registry, refuses new requests with UNAVAILABLE, lets the running ones finish for up to the
drain timeout, then ends the rest with UNAVAILABLE (trailing `epd-migrate-reason: drain`) so their routers
migrate them. A request that names its router's open relay (`relay_id`, services/worker/relay.py) has its tokens
sent there, batched with the router's other requests per step; its Generate stream then carries only `admitted`
and its end (a closed relay ends it with UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import grpc
import torch

from services.common.dist_receiver import DistReceiver
from services.common.drain import Drain
from services.common.kv_blocks import request_blocks
from services.common.loop_mailbox import LoopMailbox
from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.common.tls import Dialer, internal_client
from services.common.tracing import StageSpans
from services.common.transport_dist import DistError
from services.common.transport_grpc import StreamError
from services.worker.config import WorkerConfig
from services.worker.embedding_store import EmbeddingStore
from services.worker.engine.kv_connector import KVChunk
from services.worker.engine.request import KV_RECEIVE, KV_SEND, StepOutput
from services.worker.engine.reservation import NeverFits
from services.worker.engine_host.host import EngineHost, call_sinks
from services.worker.engine_host.process_host import EngineGone
from services.worker.held_embeddings import HeldEmbeddings
from services.worker.kv_transfer import KVAssembler, KVPusher, is_failure, kv_transport, receive_dist_chunk
from services.worker.messages import by_choice, engine_request, response
from services.worker.metrics import WorkerMetrics
from services.worker.push_receiver import PushReceiver
from services.worker.relay import Relay
from services.worker.request_inputs import EmbeddingFetches, kv_deadline
from services.worker.stream_ends import Drained, ending

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        host: EngineHost,
        store: EmbeddingStore,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        dist: DistReceiver | None = None,
    ) -> None:
        self._host = host
        self._store = store
        self._held = HeldEmbeddings(host, config.embedding_buffer_bytes)
        self._config = config
        self._metrics = metrics
        self._dist = dist or DistReceiver.for_service(config.host, config.address, device=config.device)
        self._pushes = PushReceiver(self._put_embedding, self._dist, self._count_pushed)
        self._outbox: LoopMailbox | None = None
        host.deliver = self._deliver  # a step's outputs: one wake-up of this event loop for all of them
        self.drain = Drain()
        self._streams: dict[str, asyncio.Queue] = {}  # in-flight requests' output queues (drain ends them)
        self._relays: dict[str, Relay] = {}  # open relays by id (services/worker/relay.py)
        self._pushers: dict[str, KVPusher] = {}  # remote prefills' KV streams to their decode workers
        self._dialer = Dialer(internal_client(config))
        if config.kv_transport == "dist" and internal_client(config) is not None:
            log.warning("EPD_KV_TRANSPORT=dist: KV bytes move over gloo without TLS")
        hostname = config.address.rpartition(":")[0] or config.host
        self._kv_transport = kv_transport(config.kv_transport, self._stub, hostname, config.kv_transfer_timeout_s)
        if hasattr(host, "deliver_kv"):
            host.deliver_kv = self._deliver_kv

    def _put_embedding(self, mm_hash: str, tensor: torch.Tensor) -> None:
        self._store.put(mm_hash, tensor)

    def _count_pushed(self, nbytes: int, transport: str) -> None:
        self._metrics.transfer_bytes.add(nbytes, {"transport": transport})

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._dialer.channel(address))

    def _mailbox(self) -> LoopMailbox:
        """The one mailbox from the engine thread to this event loop (a step's tokens: one wake-up)."""
        if self._outbox is None:
            self._outbox = LoopMailbox(asyncio.get_running_loop())
        return self._outbox

    def _deliver(self, batch: list) -> None:
        """From the engine's thread: run each output's sink (its request's queue) on this event loop."""
        self._mailbox_from_thread().post(call_sinks, batch)

    def _deliver_kv(self, chunks: list[KVChunk]) -> None:
        """From the engine's thread: a step's KV chunks, onto their requests' push streams (on this event loop)."""
        self._mailbox_from_thread().post(self._route_kv, chunks)

    def _route_kv(self, chunks: list[KVChunk]) -> None:
        for chunk in chunks:
            pusher = self._pushers.get(chunk.request_id)
            if pusher is not None:
                pusher.put(chunk)
                if chunk.first_token is not None:
                    pusher.close()

    def _mailbox_from_thread(self) -> LoopMailbox:
        if self._outbox is None:  # outputs follow an admission, which made it on the loop
            raise RuntimeError("engine output before any admission")
        return self._outbox

    def capacity_blocks(self) -> int:
        """The most blocks one request could ever reserve here."""
        return math.floor(self._host.kv_state.total_blocks * self._config.overcommit)

    async def _admit(
        self, request: worker_pb2.WorkerRequest, context: grpc.aio.ServicerContext, outputs: asyncio.Queue
    ) -> float:
        """Reserve and enqueue the request; returns the admission time (worker clock) or aborts the RPC."""
        self._mailbox()
        try:
            admitted = await asyncio.wrap_future(self._host.add_admitted(engine_request(request), outputs.put_nowait))
        except NeverFits as exc:  # the engine's one capacity check: another worker may hold it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineGone as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self._config.address}: {exc}")
        if admitted is None:
            state, sampling, caching = self._host.kv_state, request.sampling, self._config.enable_prefix_caching
            prompt = len(request.token_ids)
            needed = request_blocks(prompt, sampling.max_tokens, sampling.n, state.block_size, caching)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker has {state.total_blocks - state.reserved_blocks} unreserved KV blocks, request needs {needed}",
            )
        return admitted

    def end_in_flight(self) -> None:
        """Drain timeout: end every request still streaming (each answers UNAVAILABLE, its router migrates it)."""
        for outputs in self._streams.values():
            outputs.put_nowait(Drained())

    async def Generate(self, request: worker_pb2.WorkerRequest, context: grpc.aio.ServicerContext):
        if not self.drain.enter():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self._config.address} is draining")
        try:
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.drain.leave()

    async def _generate(self, request: worker_pb2.WorkerRequest, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        stages = StageSpans()  # worker.queue, worker.prefill, worker.decode under the caller's span
        outputs: asyncio.Queue = asyncio.Queue()
        direction = request.kv_transfer.direction if request.HasField("kv_transfer") else ""
        pusher = None
        if direction == KV_SEND:  # open before admitting: the first step's chunks may follow at once
            peer, timeout_s = request.kv_transfer.peer, self._config.kv_transfer_timeout_s
            pusher = KVPusher(self._stub(peer), timeout_s, self._kv_transport, peer)
            self._pushers[request.request_id] = pusher
        skip_blocks = 0
        try:
            admitted_at = await self._admit(request, context, outputs)
            if direction == KV_RECEIVE:
                rid = request.request_id
                skip_blocks = await asyncio.wrap_future(self._host.submit(lambda e: e.kv_connector.skip_blocks(rid)))
        except BaseException as exc:
            if pusher is not None:
                self._pushers.pop(request.request_id, None)
                pusher.cancel()
            if isinstance(exc, asyncio.CancelledError):  # the caller left mid-admission: the engine may hold it
                self._host.abort(request.request_id)
            raise
        admitted_from = time.perf_counter()
        stages.mark("worker.queue", {"epd.prompt_tokens": len(request.token_ids), "epd.items": len(request.media)})
        self._streams[request.request_id] = outputs
        relay = self._relays.get(request.relay_id) if request.relay_id else None
        if relay is not None:
            relay.bind(request.request_id, outputs)
        timeout = request.embedding_timeout_s or self._config.embedding_timeout_s
        media = [] if direction == KV_RECEIVE else request.media  # a remote prefill's embeddings go to the prefill
        # an item of several spans (a video's frame groups) is fetched once; one the engine holds (pinned now), never
        hashes = [h for h in dict.fromkeys(m.mm_hash for m in media) if not self._held.holds(h)]
        wait = self._metrics.embedding_wait_seconds.record
        embeddings = EmbeddingFetches(hashes, self._store, self._held.provide, wait, outputs, timeout)
        kv_wait = None
        if direction == KV_RECEIVE:  # its prefill worker may die or stall: the reservation is not held forever
            kv_wait = asyncio.create_task(kv_deadline(outputs, self._config.kv_transfer_timeout_s))
        finished = False
        first_token = True
        generated = cached = 0
        try:
            yield worker_pb2.WorkerResponse(admitted=True, state_at=admitted_at, kv_skip_blocks=skip_blocks)
            while True:
                outs = [await outputs.get()]
                while not outputs.empty() and isinstance(outs[-1], StepOutput) and not outs[-1].request_finished:
                    outs.append(outputs.get_nowait())  # the loop fell behind: one message per choice for all of them
                last = outs[-1]
                await self._abort_unless_output(last, context)
                if pusher is not None and last.finish_reason == "kv_sent":
                    await self._kv_sent(pusher, request.kv_transfer.peer, context, start)
                finished = last.request_finished
                generated += sum(len(out.new_token_ids) for out in outs)
                cached = next((out.cached_tokens for out in reversed(outs) if out.index == 0), cached)
                opening = first_token  # this message carries the first tokens: and the embedding wait
                if first_token:
                    first_token = False
                    if kv_wait is not None:
                        kv_wait.cancel()
                    self._metrics.prefill_seconds.record(time.perf_counter() - start)
                    prefill = {"gen_ai.usage.prompt_tokens": len(request.token_ids), "epd.cached_tokens": cached}
                    stages.mark("worker.prefill", prefill)
                if finished:
                    self._metrics.record_finished(len(request.token_ids), cached, generated)
                    stages.mark("worker.decode", {"gen_ai.usage.completion_tokens": generated})
                freed_at = self._host.finished_at.pop(request.request_id, 0.0) if finished else 0.0
                for group in by_choice(outs):
                    message = response(group, time.perf_counter() - start, freed_at if group[-1] is last else 0.0)
                    if opening:
                        message.encode_wait_s = embeddings.seconds_after(admitted_from)
                    if relay is None:
                        yield message
                    else:
                        message.request_id = request.request_id
                        relay.send(message)
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if pusher is not None:
                self._pushers.pop(request.request_id, None)
                if not finished:
                    pusher.cancel()
            if relay is not None:
                relay.unbind(request.request_id, outputs)
            embeddings.cancel()
            if kv_wait is not None:
                kv_wait.cancel()
            if not finished:
                self._host.abort(request.request_id)
                stages.mark("worker.ended", {"gen_ai.usage.completion_tokens": generated}, error="ended early")
            self._host.finished_at.pop(request.request_id, None)

    async def _abort_unless_output(self, last: object, context: grpc.aio.ServicerContext) -> None:
        """Abort the call when what ended the request's outputs is not the engine's (services/worker/stream_ends.py)."""
        ended = ending(last, self._config.address)
        if ended is not None:
            code, message, metadata = ended
            await context.abort(code, message, trailing_metadata=metadata)

    async def _kv_sent(self, pusher: KVPusher, peer: str, context: grpc.aio.ServicerContext, start: float) -> None:
        """A remote prefill's last chunk went: wait until the decode worker holds every block (only then is this
        prefill done; UNAVAILABLE if the push failed), then count the bytes and the time."""
        try:
            await pusher.ack()
        except Exception as exc:
            if not is_failure(exc):
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push to {peer} failed: {exc}")
        for transport, sent in pusher.bytes.items():  # a dist push's inline fallbacks count as grpc
            self._metrics.kv_transfer_bytes.add(sent, {"direction": "sent", "transport": transport})
        self._metrics.kv_transfer_seconds.record(time.perf_counter() - start)

    async def Relay(self, request: worker_pb2.RelayOpen, context: grpc.aio.ServicerContext):
        """A router's relay (services/worker/relay.py): open until the router ends it or this worker stops. Not
        counted by the drain: it carries the draining requests' last tokens."""
        if not request.relay_id or request.relay_id in self._relays:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"relay id {request.relay_id!r} is empty or in use")
        relay = self._relays[request.relay_id] = Relay(request.relay_id)
        try:
            async for batch in relay.batches():
                yield batch
                self._metrics.relayed_responses.add(len(batch.responses))
        finally:
            self._relays.pop(request.relay_id, None)
            relay.close()

    async def PushEmbeddings(self, request_iterator, context: grpc.aio.ServicerContext) -> worker_pb2.PushAck:
        return await self._pushes.push_embeddings(request_iterator, context)

    async def PushKV(self, request_iterator, context: grpc.aio.ServicerContext) -> worker_pb2.PushAck:
        """A prefill worker's KV chunks for requests admitted here to receive them, written into the engine's pool
        in order; a chunk of a request not receiving here (aborted, re-admitted) is dropped by the engine. A chunk
        naming a torch.distributed pair (`KVBlocks.pair_id`) has its bytes received on that pair's thread; one that
        fails ends the stream UNAVAILABLE."""
        assembler = KVAssembler()
        chunks = dist_bytes = 0
        try:
            async for message in request_iterator:
                if message.pair_id:
                    assembler.finish()  # a dist chunk never starts inside an inline one
                    chunk = await receive_dist_chunk(self._dist, message)
                    dist_bytes += chunk.nbytes
                else:
                    chunk = assembler.add(message)
                if chunk is not None:
                    await asyncio.wrap_future(self._host.receive_kv(chunk))
                    chunks += 1
            assembler.finish()
        except (StreamError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV stream: {exc}")
        except DistError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV over torch.distributed failed: {exc}")
        self._metrics.kv_transfer_bytes.add(assembler.total_bytes, {"direction": "received", "transport": "grpc"})
        if dist_bytes:
            self._metrics.kv_transfer_bytes.add(dist_bytes, {"direction": "received", "transport": "dist"})
        return worker_pb2.PushAck(items=chunks, bytes=assembler.total_bytes + dist_bytes)

    async def DistConnect(
        self, request: worker_pb2.DistConnectRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DistConnectReply:
        return await self._pushes.dist_connect(request, context)

    async def PushDist(self, request: worker_pb2.DistTransfer, context: grpc.aio.ServicerContext) -> worker_pb2.PushAck:
        return await self._pushes.push_dist(request, context)

    def end_relays(self) -> None:
        """End every open relay's stream (at stop, after the drain: what was bound to one has ended); a server
        stopping with a relay still open would wait out its grace, then cancel it."""
        for relay in list(self._relays.values()):
            relay.close()

    def close(self) -> None:
        self._dist.close()
        self._kv_transport.close()

    async def Abort(
        self,
        request: worker_pb2.AbortRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.AbortReply:
        try:
            found = await asyncio.wrap_future(self._host.abort(request.request_id))
        except EngineGone:
            found = False  # its engine process is gone, and the request with it
        return worker_pb2.AbortReply(found=found)
