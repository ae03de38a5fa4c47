"""The router service: the public `Generation` API (Generate, CountTokens).

Per request: intake and accounting (no GPU work), admission onto a worker that reserves the
request's KV blocks (its Generate stream, opened at once so text can prefill), the uncached
items sent to an encoder with that worker as destination, then tokens detokenized and streamed.
Every failure ends the stream with a status naming the problem; the worker call and the encode
task are cancelled on every exit path, which frees the worker's reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from services.common.drain import Drain
from services.common.grammar import constraint_of
from services.common.logs import current_request_id
from services.common.model_info import ModelInfo
from services.common.rpc.epd.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from services.common.tls import Dialer
from services.common.tracing import tracer
from services.router.accounting import Accounted
from services.router.admission import Admission, Rejection, Reserved
from services.router.auth import DEFAULT_TENANT
from services.router.cluster_view import ClusterView, WorkerView
from services.router.config import RouterConfig
from services.router.encode_dispatch import EncodeDispatcher, Pending, media_sources
from services.router.errors import RequestError
from services.router.metrics import RouterMetrics
from services.router.migration import Migrations, Progress, WorkerLost, continuation, lost_reason, watch_vanished
from services.router.output import Choices, TokenTexts
from services.router.pd_choice import PrefillPlacement
from services.router.relay import Relays
from services.router.remote_prefill import PrefillFailed, RemotePrefill, receiving
from services.router.request_blocks import RequestBlocks
from services.router.request_prep import RequestPrep
from services.router.request_record import RequestRecord, admission_attributes, note_step, note_worker
from services.router.stream_state import StreamState
from services.router.tenants import Tenancy, prefix_salt, scope_items
from services.router.worker_stream import RelayLostError, WorkerStream, open_worker

log = logging.getLogger(__name__)
DRAINING = "router is draining (shutting down): send the request to another router replica"


PREFILL_LOST = "prefill"  # a migration's reason when the remote prefill failed: the request is prefilled locally next


@dataclass
class Placed:
    """An admitted attempt: its decode worker's stream and, for a remote prefill, the prefill worker's view and the
    request as the decode worker got it (to receive its KV)."""

    stream: WorkerStream
    prefill: WorkerView | None = None
    request: worker_pb2.WorkerRequest | None = None


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
        pairing: PrefillPlacement | None = None,
    ) -> None:
        self._info = info
        self._config = config
        self._prep = prep
        self._admission = admission
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._dialer = dialer
        self._view = view
        self._tenancy = tenancy
        self._pairing = pairing  # the (prefill, decode) pair of a request (router/pd_choice.py); None: always local
        self._remote_prefill = RemotePrefill(view, self.channel)
        self._prefills_left: set[asyncio.Task] = set()  # remote prefills awaiting their ack after their stream ended
        self._token_texts = TokenTexts(info.adapter.tokenizer)
        self.relays = Relays(self.channel)  # one token stream per worker for all of this router's requests
        self.drain = Drain()  # gRPC calls being served; refused with UNAVAILABLE once the router drains

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to a worker or encoder: mTLS with the cluster CA when TLS is on, so an address that
        someone registered in Redis gets no request unless it holds a certificate of that CA."""
        return self._dialer.channel(address)

    def authenticate(self, authorization: Iterable[str]) -> str:
        """The caller's tenant from its `authorization` values, for any front end; RequestError
        (UNAUTHENTICATED) before any other work when the key is missing or wrong."""
        return self._tenancy.auth.tenant(authorization)

    async def CountTokens(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> generation_pb2.TokenCount:
        if not self.drain.enter():
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        try:
            self._tenancy.auth.grpc_tenant(context)
            return await self.count_tokens(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self.drain.leave()

    async def count_tokens(self, request: generation_pb2.GenerateRequest) -> generation_pb2.TokenCount:
        """CountTokens for any front end (gRPC, HTTP); raises RequestError. Each call is counted once, by outcome."""
        outcome = "ok"
        try:
            return (await self._prep.prepare(request)).accounted.token_count()
        except RequestError as exc:
            outcome = exc.code.name.lower()
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception:
            outcome = "internal"
            raise
        finally:
            self._metrics.count_tokens.add(1, {"outcome": outcome})

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self.drain.enter():
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        try:
            tenant = self._tenancy.auth.grpc_tenant(context)
            async for response in self.generate_stream(request, context.time_remaining(), tenant):
                yield response
        except RequestError as exc:
            if exc.metadata:
                context.set_trailing_metadata(exc.metadata)
            await context.abort(exc.code, exc.message)
        finally:
            self.drain.leave()

    async def generate_stream(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None, tenant: str = DEFAULT_TENANT
    ):
        """Generate for any front end (gRPC, HTTP) on behalf of `tenant` (authenticated by the caller): the
        responses, or RequestError. Every request is counted in the metrics here, once, by tenant. The
        deadline is `timeout_s` (None: none) capped by the request timeout; closing the generator or
        cancelling its task cancels the worker call and frees its blocks."""
        start = time.perf_counter()
        outcome = "ok"
        failure = refusal = ""
        gate = self._tenancy.gate
        self._metrics.running.add(1)
        record = RequestRecord.begin(request, tenant, self._info.model_dir.resolve().name)  # span and finished line
        entered = False
        try:
            gate.enter(tenant)
            entered = True
            async for response in self._generate(request, timeout_s, start, tenant):
                if response.HasField("final"):
                    record.final = response.final
                yield response
        except RequestError as exc:
            outcome, failure = exc.code.name.lower(), exc.message
            if isinstance(exc, Rejection):
                refusal = exc.reason
                self._metrics.rejections.add(1, {"reason": exc.reason, "tenant": tenant})
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception:
            outcome = "internal"
            log.exception("request failed unexpectedly")
            raise
        finally:
            if entered:
                gate.leave(tenant)
            self._metrics.running.add(-1)
            self._metrics.requests.add(1, {"outcome": outcome, "tenant": tenant})
            self._metrics.e2e_seconds.record(time.perf_counter() - start)
            record.finish(outcome, failure, refusal)

    async def _open_worker(
        self,
        worker: str,
        request: worker_pb2.WorkerRequest,
        blocks: RequestBlocks,
        deadline: float,
        local: bool,
    ) -> Reserved[Placed] | None:
        """Admission's try of `worker`: when the pairing picks a prefill worker for it (`local` False), `worker` is
        the decode side and admits the request to receive its KV; otherwise it prefills the request itself."""
        prefill = None
        decode = None if local or self._pairing is None else self._view.worker(worker)
        if decode is not None:
            transferable = request.sampling.n <= 1 and constraint_of(request.sampling) is None
            prefill = self._pairing.prefill_for(blocks, decode, transferable=transferable)
        if prefill is not None:
            request = receiving(request)
        reserved = await open_worker(self.channel(worker), worker, request, deadline, self.relays.ready(worker))
        if reserved is None:
            return None
        return Reserved(Placed(reserved.handle, prefill, request if prefill is not None else None), reserved.at)

    async def _generate(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None, start: float, tenant: str
    ):
        """Admit, encode, stream; a worker failing mid-stream: continue on another (router/migration.py).
        The tenant is folded into the prefix salt and the items' keys here, before anything downstream."""
        intake_from = time.perf_counter()
        sources = media_sources(request, tenant)
        # no encoder has room for its unknown images (with those of the requests ahead): refused before any work
        pending = self._dispatcher.precheck(sources)
        try:
            with tracer().start_as_current_span("intake") as intake:  # parse, fetch, count; no text in the span
                prepared = await self._prep.prepare(request)
                intake.set_attribute("epd.items", len(prepared.accounted.refs))
                intake.set_attribute("epd.prompt_tokens", prepared.accounted.prompt_tokens)
            note_step("intake")
            accounted, sampling = prepared.accounted, prepared.sampling
            self._tenancy.gate.charge(tenant, accounted.projected_tokens)
            scope_items(accounted.refs, tenant, self._tenancy.share_embeddings)
            request_id = current_request_id() or request.request_id or uuid.uuid4().hex  # RequestRecord bound it
            timeout = min(self._config.request_timeout_s, timeout_s if timeout_s is not None else float("inf"))
            deadline = time.monotonic() + timeout
            base = worker_pb2.WorkerRequest(
                request_id=request_id,
                token_ids=accounted.token_ids,
                media=accounted.worker_media(),
                sampling=sampling,
                cache_salt=prefix_salt(tenant, request.cache_salt),
                embedding_timeout_s=min(timeout, self._config.encode_timeout_s),
            )
            choices = Choices(self._info.adapter.tokenizer, list(sampling.stop), sampling.n, self._token_texts)
            intake_s = time.perf_counter() - intake_from
            state = StreamState(
                choices,
                Progress(sampling.n),
                start,
                intake_s,
                prompt_tokens=accounted.prompt_tokens,
                tools=prepared.tools,
            )
            migrations = Migrations(
                self._config.migration_limit, lambda reason: self._metrics.migrations.add(1, {"reason": reason})
            )
            local = False  # after a remote prefill failed, the request prefills on its decode worker
            while not choices.done:
                attempt = continuation(base, state.progress, migrations.done)
                try:
                    run = self._attempt(attempt, accounted, deadline, state, sources, pending, local)
                    async with contextlib.aclosing(run) as chunks:
                        async for chunk in chunks:
                            yield generation_pb2.GenerateResponse(chunk=chunk)
                    break
                except WorkerLost as lost:
                    local = local or lost.reason == PREFILL_LOST
                    trace.get_current_span().add_event(
                        "migration", {"epd.reason": lost.reason, "epd.worker": lost.worker}
                    )
                    migrations.next(lost, state.progress)  # raises UNAVAILABLE past the limit
                    log.warning("request %s: %s; migrating (%d so far)", request_id, lost, migrations.done)
            yield generation_pb2.GenerateResponse(final=state.final(accounted, request_id, migrations.done))
        finally:
            self._dispatcher.settle(pending)  # a request that ended before `check_room`

    async def _attempt(
        self,
        worker_request: worker_pb2.WorkerRequest,
        accounted: Accounted,
        deadline: float,
        state: StreamState,
        sources: list[str],
        pending: Pending,
        local: bool = False,
    ):
        """One worker serving the request: admission, the encode task, the stream; the chunks for the client
        (`sources`: its media's `media_sources` keys, remembered once their embeddings are cached; `pending`: what
        `precheck` counted for them, settled by `check_room`). With a remote
        prefill (placement paired the worker with a prefill worker; never when `local`) the embeddings go to the
        prefill worker and a task runs its prefill, whose failure cancels the stream (WorkerLost, reason
        PREFILL_LOST). Raises WorkerLost when the worker fails in a way another worker may cure."""
        blocks = RequestBlocks.for_prompt(
            list(worker_request.token_ids),
            accounted.projected_tokens,
            accounted.media_spans(),
            worker_request.cache_salt,
            accounted.n,
        )
        items = await self._dispatcher.uncached(list(accounted.refs), accounted.item_data)
        note_step("lookup")
        if len(sources) == len(accounted.refs):  # the found ones are let by `precheck` from now on
            missing = {item.ref.mm_hash for item in items}
            found = [key for key, ref in zip(sources, accounted.refs, strict=True) if ref.mm_hash not in missing]
            self._dispatcher.remember(found)
        booking = self._dispatcher.check_room(items, pending)  # no room: refused before a worker reserves
        try:
            with tracer().start_as_current_span("admission") as placing:  # the worker call opened here is its child
                admitted = await self._admission.admit(
                    blocks, lambda worker: self._open_worker(worker, worker_request, blocks, deadline, local), deadline
                )
                placing.set_attributes(admission_attributes(admitted))
        except BaseException:
            self._dispatcher.release(booking)  # its items go to no encoder
            raise
        note_worker(admitted.worker)
        note_step("placed")
        self._metrics.queue_seconds.record(admitted.queue_s)
        state.queue_s += admitted.queue_s
        placed: Placed = admitted.handle
        call = placed.stream
        prefill = None
        destination = admitted.worker
        if placed.prefill is not None:  # remote prefill: the embeddings go to the prefill worker
            destination = placed.prefill.address
            run = self._remote_prefill.run(
                destination, placed.prefill.block_size, placed.request, admitted.worker, call.kv_skip_blocks, deadline
            )
            prefill = asyncio.create_task(run, name=destination)  # named after its prefill worker
            prefill.add_done_callback(lambda task: self._prefill_done(task, call))
        encode = asyncio.create_task(
            self._dispatcher.encode_items(worker_request.request_id, items, destination, deadline, booking)
        )
        encode.add_done_callback(lambda task: task.cancelled() or task.exception() is None or call.cancel())
        encode.add_done_callback(lambda task: self._record_encode(task, state, sources))
        vanished = asyncio.Event()
        watch = asyncio.create_task(
            watch_vanished(self._view.absent_for, admitted.worker, lambda: (vanished.set(), call.cancel()))
        )
        end = StreamEnd()
        served = False
        try:
            stream = self._stream(call, admitted.worker, encode, vanished, state, end, prefill, deadline)
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    yield chunk
            served = True
        finally:
            watch.cancel()
            call.cancel()
            encode.cancel()
            if prefill is not None and not prefill.done():
                if served:  # the tokens came, so the KV did: let the prefill worker's call end on its ack
                    self._prefills_left.add(prefill)
                    prefill.add_done_callback(self._prefills_left.discard)
                else:
                    prefill.cancel()
            self._admission.released(admitted.worker, admitted.blocks, end.released_at)

    def _prefill_done(self, task: asyncio.Task, call: WorkerStream) -> None:
        """A remote prefill ended: counted by outcome; a failure cancels the decode side's stream (`_stream` then
        raises WorkerLost for the prefill worker)."""
        outcome = "cancelled" if task.cancelled() else "failed" if task.exception() is not None else "sent"
        self._metrics.remote_prefills.add(1, {"outcome": outcome})
        if outcome == "failed":
            call.cancel()

    def _record_encode(self, task: asyncio.Task, state: StreamState, sources: list[str]) -> None:
        """Encode time of the items sent to encoders (the task may end after the last token); the request's
        media are cached from now on."""
        if not task.cancelled() and task.exception() is None:
            self._dispatcher.remember(sources)
        if not task.cancelled() and task.exception() is None and task.result().seconds > 0:
            self._metrics.encode_seconds.record(task.result().seconds)
            state.encode_s += task.result().seconds
            state.encode_stages.MergeFrom(task.result().stages)  # a migration's encode: the later one's stages

    async def _stream(
        self,
        call: WorkerStream,
        worker: str,
        encode: asyncio.Task,
        vanished: asyncio.Event,
        state: StreamState,
        end: StreamEnd,
        prefill: asyncio.Task | None = None,
        deadline: float = float("inf"),
    ):
        """The worker's responses as client chunks until every choice is done or the stream ends. `prefill`: the
        remote prefill's task, whose failure, or the decode worker's deadline for its KV, is WorkerLost of the
        prefill worker (the next attempt prefills locally)."""
        answered = False  # a response of this attempt arrived (after a remote prefill: its KV did)
        try:
            while (response := await call.read()) is not None:
                answered = True
                end.released_at = response.state_at or end.released_at  # set on the worker's last message only
                chunk = state.take(response, self._metrics)
                if chunk is not None:
                    yield chunk
                if state.choices.done:  # every choice finished, or ended here at a stop string
                    break
        except RelayLostError as exc:
            raise WorkerLost(worker, "relay", str(exc)) from None
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if prefill is not None and prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
                failed = prefill.exception()
                worker_name = failed.worker if isinstance(failed, PrefillFailed) else worker
                raise WorkerLost(worker_name, PREFILL_LOST, str(failed)) from None
            if (
                prefill is not None
                and isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                and not answered  # before its first token: the KV is what it waited for
                and time.monotonic() < deadline
            ):  # the decode worker's deadline for the KV passed (EPD_KV_TRANSFER_TIMEOUT_S), not the request's;
                prefill.cancel()  # a prefill still running is given up (one that ended late was dropped there)
                raise WorkerLost(prefill.get_name(), PREFILL_LOST, f"its KV did not arrive: {exc.details()}") from None
            if vanished.is_set():
                raise WorkerLost(worker, "vanished", "missing from the registry") from None
            if encode.done() and not encode.cancelled() and encode.exception() is not None:
                error = encode.exception()
                if isinstance(error, RequestError) and error.code == grpc.StatusCode.UNAVAILABLE:
                    if prefill is not None:  # the embeddings went to the prefill worker: it is the one gone
                        raise WorkerLost(prefill.get_name(), PREFILL_LOST, f"encode: {error.message}") from None
                    raise WorkerLost(worker, "encode", error.message) from None  # e.g. the push found it gone
                raise error from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            reason = lost_reason(exc)
            if reason is not None:
                raise WorkerLost(worker, reason, f"{exc.code().name}: {exc.details()}") from exc
            raise RequestError(exc.code(), f"worker {worker}: {exc.details()}") from exc
