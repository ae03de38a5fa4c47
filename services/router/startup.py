"""Starting the router: the model's accounting side (no weights), the cluster view, admission, the encode
dispatcher and the `Generation` servicer, served over gRPC and HTTP; its stop function drains both."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.common import grpc_server, tls
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.model_info import load_model_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2_grpc
from services.common.telemetry import Telemetry
from services.common.tls import Dialer
from services.router.admission import Admission, AdmissionSettings
from services.router.cluster_view import ClusterView
from services.router.config import RouterConfig
from services.router.encode_dispatch import EncodeDispatcher
from services.router.http_server import serve_router_http
from services.router.metrics import RouterMetrics
from services.router.pd_choice import PrefillPlacement, PrefillPolicy
from services.router.placement import PrefixAffinity
from services.router.request_prep import RequestPrep
from services.router.server import GenerationServicer
from services.router.tenants import Tenancy

log = logging.getLogger(__name__)

LEAVE_S = 1.0
"""How long a draining router keeps its gRPC server up at least, answering new calls UNAVAILABLE: time for the
clients that watch its health (gRPC `healthCheckConfig`) to see NOT_SERVING and send elsewhere before it
stops (a gRPC server that is stopping cancels the calls it still receives: CANCELLED, which clients do not
retry; grpc/grpc#41785)."""


def _count_lookup(metrics: RouterMetrics, queries: int, hits: int) -> None:
    metrics.cache_queries.add(queries)
    if hits:
        metrics.cache_hits.add(hits, {"tier": "redis"})


async def start_router(config: RouterConfig) -> Callable[[], Awaitable[None]]:
    """Serve the public API on config.host:config.port (no model weights are loaded here)."""
    info = load_model_info(config.model)
    telemetry = Telemetry("router", config.host, config.metrics_port, info.model_dir.resolve().name)
    telemetry.watch_loop()
    metrics = RouterMetrics.create(telemetry)
    cache = EmbeddingCache(CacheSettings.for_service(config, info.identity.revision, max_bytes=0))
    view = ClusterView(Registry(config.redis_url), info.identity.revision)
    await view.start()
    dialer = Dialer(tls.internal_client(config))
    affinity = PrefixAffinity()
    admission = Admission(
        view,
        affinity,
        AdmissionSettings(
            config.admission_queue_size,
            config.admission_max_wait_s,
            config.retry_after_ms,
            config.prefix_affinity_weight,
        ),
    )
    prep = RequestPrep(info, config, metrics)
    pairing = None  # without a threshold every request prefills where it decodes: nothing to look up per admission
    if config.pd_min_prefill_tokens:
        policy = PrefillPolicy(config.pd_min_prefill_tokens, config.pd_max_prefill_waiting)
        pairing = PrefillPlacement(policy, view, affinity)
    servicer = GenerationServicer(
        info,
        config,
        prep,
        admission,
        EncodeDispatcher(
            view,
            cache,
            lambda a: servicer.channel(a),
            config.encoder_addrs,
            on_lookup=lambda queries, hits: _count_lookup(metrics, queries, hits),
            hold_s=config.admission_max_wait_s,
        ),
        metrics,
        dialer,
        view,
        Tenancy.from_config(config),
        pairing,
    )
    binding = grpc_server.ServiceBinding(
        generation_pb2_grpc.add_GenerationServicer_to_server, servicer, "epd.v1.Generation"
    )
    stop_http = await serve_router_http(config, info, servicer, view, metrics, prep)  # listening before gRPC is healthy
    public = config.public_tls()
    credentials = None if public is None else tls.server_credentials(public, bool(public.ca_file))
    running = await grpc_server.start_server(
        config.host, config.port, [binding], credentials, echo_request_id=True, health_port=config.health_port
    )
    log.info("router serving on %s:%d", config.host, running.port)

    async def drain_grpc() -> None:
        idle, _ = await asyncio.gather(
            servicer.drain.wait_idle(config.drain_timeout_s), asyncio.sleep(min(LEAVE_S, config.drain_timeout_s))
        )
        if not idle:
            log.warning(
                "drain: %d gRPC call(s) still running after %.1fs", servicer.drain.in_flight, config.drain_timeout_s
            )
        await running.stop(0.5)

    async def stop() -> None:
        """Drain: health NOT_SERVING and new gRPC calls refused with UNAVAILABLE (the server keeps running, so a
        client never meets a stopping server, which cancels what it receives), the HTTP API stops accepting;
        the streams in flight finish for up to EPD_DRAIN_TIMEOUT_S (they may still migrate meanwhile: the view
        and channels stay open), and the gRPC server stays up at least LEAVE_S; then everything closes."""
        servicer.drain.start()
        await running.health.enter_graceful_shutdown()
        await asyncio.gather(stop_http(), drain_grpc())
        await view.stop()
        await servicer.attempts.close()
        await dialer.close()
        telemetry.shutdown()

    return stop
