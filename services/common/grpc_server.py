"""Building an asyncio gRPC server with health checking and reflection on every service.

With a health port, the same health servicer also answers on a plaintext listener bound to 127.0.0.1 that
serves nothing else: the pod's probes ask it where the service port speaks TLS (the kubelet's gRPC probe has
none, and a router's public pair or public client CA may not be the cluster's), so every probe in every TLS
mode reads the one status `grpc.health.v1` answers on the service port.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.rpc_context import ServerContextInterceptor

MAX_MESSAGE_BYTES = 64 << 20  # requests carry inline images; embeddings still move in ~1 MiB chunks


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer and how to add it: `add(servicer, server)` plus its full proto service name."""

    add: Callable[[object, grpc.aio.Server], None]
    servicer: object
    name: str


@dataclass
class RunningServer:
    """A started server; ``health_listener`` is the loopback health listener (None without a health port)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    health_listener: grpc.aio.Server | None = None

    async def set_serving(self, names: Sequence[str], serving: bool = True) -> None:
        """Health of the whole server ("") and of each named service: SERVING, or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_listener is not None:
            await self.health_listener.stop(0)


async def start_server(
    host: str,
    port: int,
    bindings: Sequence[ServiceBinding],
    credentials: grpc.ServerCredentials | None = None,
    echo_request_id: bool = False,
    serving: bool = True,
    health_port: int = 0,
) -> RunningServer:
    """Start a server on host:port (port 0 picks a free one) with health and reflection; over TLS when
    `credentials` (services/common/tls.py), else plaintext. Health and reflection share the port and its TLS.
    Every method runs with the caller's trace context and request id bound (services/common/rpc_context.py);
    `echo_request_id` sends a client's `x-request-id` back (the public API). With `serving=False` health says
    NOT_SERVING until the caller calls `set_serving` (a service that must register first). A `health_port`
    starts the loopback health listener (`start_health_listener`) on it."""
    server = grpc.aio.server(
        interceptors=[ServerContextInterceptor(echo=echo_request_id)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    for binding in bindings:
        binding.add(binding.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [b.name for b in bindings]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    listener = await start_health_listener(health_servicer, health_port) if health_port else None
    running = RunningServer(server, health_servicer, bound, listener)
    await running.set_serving(names, serving)
    return running


async def start_health_listener(servicer: health.aio.HealthServicer, port: int) -> grpc.aio.Server:
    """A plaintext server on 127.0.0.1:`port` with `servicer` (the service port's own) and nothing else: no
    reflection, no service of the cluster, unreachable from outside the pod's network namespace."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind the health listener to 127.0.0.1:{port}")
    await server.start()
    return server


RECONNECT_BACKOFF_MS = (200, 1000)
"""A channel's reconnect back-off after its peer went away: first and longest wait. gRPC's own (1 s growing to
120 s) left a router unable to reach a worker that restarted at the same address for seconds to minutes (the
channel waits out its back-off before it dials again); peers in one cluster come back within seconds."""


def channel_options() -> list[tuple[str, int]]:
    """Client channel options: the server's message caps, and a reconnect back-off capped at a second."""
    first, longest = RECONNECT_BACKOFF_MS
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", longest),
    ]
