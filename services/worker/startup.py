"""Starting the worker: the model and its engine thread (or engine process), the `Worker` and co-located
`Encoder` servicers served over gRPC, and the heartbeat that publishes the KV state; `RunningWorker` drains and
stops them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from services.common import grpc_server, tls
from services.common.drain import drained
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.kv_layout import KVLayout
from services.common.media import MediaLimits
from services.common.model_info import load_model_info
from services.common.registry import Heartbeat, Registry, draining_role
from services.common.rpc.epd.v1 import encoder_pb2_grpc, worker_pb2_grpc
from services.common.service_main import dtype_of
from services.common.telemetry import Telemetry
from services.models.vision_runner import VisionRunner
from services.worker.config import WorkerConfig
from services.worker.embedding_store import EmbeddingStore
from services.worker.engine.engine import Engine
from services.worker.engine_host.fork import may_fork
from services.worker.engine_host.host import EngineHost
from services.worker.engine_host.process_host import EngineProcess
from services.worker.engine_host.thread_host import EngineLoop
from services.worker.local_encoder import LocalEncoderServicer
from services.worker.metrics import WorkerMetrics
from services.worker.server import WorkerServicer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunningWorker:
    server: grpc_server.RunningServer
    servicer: WorkerServicer
    host: EngineHost
    heartbeat: Heartbeat
    telemetry: Telemetry

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM: refuse new requests, leave the registry (publishing as draining, so routers know it is alive),
        let the running requests finish for up to `timeout_s`, then end the rest (their routers migrate them)."""
        self.servicer.drain.start()
        await self.server.health.enter_graceful_shutdown()
        await self.heartbeat.move_to(draining_role(self.heartbeat.role))
        running = self.servicer.drain.in_flight
        if not await drained(self.servicer.drain, timeout_s, self.servicer.end_in_flight):
            log.warning("drain: ended requests still running after %.1fs (of %d)", timeout_s, running)
        log.info("drain: done (%d request(s) were in flight)", running)

    async def stop(self) -> None:
        await self.heartbeat.stop()
        self.servicer.end_relays()
        await self.server.stop()
        self.servicer.close()
        self.host.stop()
        self.telemetry.shutdown()


async def start_worker(config: WorkerConfig) -> RunningWorker:
    """Load the model, start the engine thread, serve `Worker` and heartbeat the KV state."""
    info = load_model_info(config.model)
    process = None
    if config.engine_in_child():  # the child loads the model and runs the vision tower too
        process = EngineProcess(config)
        process.launch(fork=may_fork())  # before this process starts a thread: forked, it inherits the imports
    telemetry = Telemetry("worker", config.host, config.metrics_port, info.model_dir.resolve().name)
    telemetry.watch_loop()
    cache = EmbeddingCache(CacheSettings.for_service(config, info.identity.revision))
    host: EngineHost
    if process is not None:
        host, runner = process, process
    else:
        # tensor parallelism: loaded on the host, cut to rank 0's shard there, then moved (each rank loads its own)
        device = config.device if config.tensor_parallel_size == 1 else "cpu"
        model = info.adapter.load_model(device=device, dtype=dtype_of(config.dtype))
        engine = Engine(info.adapter, model, config.engine_config())
        host, runner = EngineLoop(engine, nice=config.compute_nice), VisionRunner(info.adapter, model)
    metrics = WorkerMetrics.create(telemetry.meter, lambda: host.kv_state, host.step_costs)
    host.on_step = metrics.record_step  # set before the engine starts
    await asyncio.to_thread(host.start)
    store = EmbeddingStore(cache)
    servicer = WorkerServicer(host, store, config, metrics)
    local_encoder = LocalEncoderServicer(
        runner, store, cache, MediaLimits(max_pixels=config.max_image_pixels), config.address
    )
    bindings = [
        grpc_server.ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "epd.v1.Worker"),
        grpc_server.ServiceBinding(encoder_pb2_grpc.add_EncoderServicer_to_server, local_encoder, "epd.v1.Encoder"),
    ]
    credentials = tls.internal_server_credentials(config)
    running = await grpc_server.start_server(
        config.host, config.port, bindings, credentials, serving=False, health_port=config.health_port
    )
    address = config.advertise_addr or f"{config.host}:{running.port}"
    local_encoder.address = address

    def state() -> dict:
        snapshot = host.snapshot
        return {
            **dataclasses.asdict(snapshot.state),
            "capacity_blocks": servicer.capacity_blocks(),
            "enable_prefix_caching": config.enable_prefix_caching,  # the router counts blocks as this worker does
            "tensor_parallel_size": config.tensor_parallel_size,  # devices behind this entry's blocks
            "worker_role": config.worker_role,
            "kv_layout": published_layout(snapshot.state.kv_layout, info.identity.revision),
            "snapshot_at": snapshot.at,
        }

    heartbeat = Heartbeat(
        Registry(config.redis_url, ttl_s=max(1.0, 5 * config.heartbeat_interval_s)),
        registry_role(config.worker_role),
        address,
        info.identity.revision,
        state,
        config.heartbeat_interval_s,
    )
    await heartbeat.start()
    await running.set_serving([b.name for b in bindings])  # healthy once routers can find it
    kv = host.kv_state
    log.info(
        "worker serving on %s (model %s, attention %s, %d KV blocks of %d tokens)",
        address,
        info.model_dir,
        kv.attention_backend,
        kv.total_blocks,
        kv.block_size,
    )
    return RunningWorker(running, servicer, host, heartbeat, telemetry)


def registry_role(worker_role: str) -> str:
    """The registry role a worker heartbeats under: prefill workers have their own (``prefill``), so a router places
    ordinary requests only on ``worker`` entries (roles ``both`` and ``decode``)."""
    return "prefill" if worker_role == "prefill" else "worker"


def published_layout(layout: KVLayout | None, revision: str) -> dict | None:
    """The engine's KV layout identity with the model revision the worker serves, as the registry holds it."""
    return None if layout is None else dataclasses.replace(layout, model_revision=revision).as_state()
