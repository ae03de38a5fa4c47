"""The router service: the public `Generation` API (Generate, CountTokens).

Per request: intake and accounting (no GPU work), then attempts (attempt.py: admission onto a worker that
reserves the request's KV blocks, the uncached items sent to an encoder with that worker as destination, the
tokens detokenized and streamed) until one worker serves it to the end, migrating when one is lost.
Every failure ends the stream with a status naming the problem; every request is counted once, by outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable

import grpc
from opentelemetry import trace

from services.common.drain import Drain
from services.common.logs import current_request_id
from services.common.model_info import ModelInfo
from services.common.rpc.epd.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from services.common.tls import Dialer
from services.common.tracing import tracer
from services.router.admission import Admission, Rejection
from services.router.attempt import PREFILL_LOST, Attempts
from services.router.auth import DEFAULT_TENANT
from services.router.cluster_view import ClusterView
from services.router.config import RouterConfig
from services.router.encode_dispatch import EncodeDispatcher, media_sources
from services.router.errors import RequestError
from services.router.metrics import RouterMetrics
from services.router.migration import Migrations, Progress, WorkerLost, continuation
from services.router.output import Choices, TokenTexts
from services.router.pd_choice import PrefillPlacement
from services.router.request_prep import RequestPrep
from services.router.request_record import RequestRecord, note_step
from services.router.stream_state import StreamState
from services.router.tenants import Tenancy, prefix_salt, scope_items

log = logging.getLogger(__name__)
DRAINING = "router is draining (shutting down): send the request to another router replica"


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
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._dialer = dialer
        self._tenancy = tenancy
        self._token_texts = TokenTexts(info.adapter.tokenizer)
        self._model_name = info.model_dir.resolve().name  # the finished line's model: resolved once, not per request
        self.attempts = Attempts(admission, dispatcher, metrics, view, self.channel, pairing)
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
        record = RequestRecord.begin(request, tenant, self._model_name)  # span and finished line
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
                    run = self.attempts.run(attempt, accounted, deadline, state, sources, pending, local)
                    async with contextlib.aclosing(run) as responses:
                        async for response in responses:
                            yield response
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
