"""Waiting on and checking gRPC health (`grpc.health.v1.Health`) of a service address."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the server at `address` reports SERVING for `service` ("" = the whole server)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(address: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll until SERVING; raise TimeoutError at the deadline or RuntimeError if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"process serving {address} exited")
        if check(address, timeout_s=1.0):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy within {timeout_s:.0f}s")
