"""Waiting on and checking gRPC health (`grpc.health.v1.Health`) of a service address."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import ClientTls, client_from_env, sync_channel


def check(address: str, service: str = "", timeout_s: float = 2.0, tls: ClientTls | None = None) -> bool:
    """True when the server at `address` reports SERVING for `service` ("" = the whole server); over
    mTLS with `tls` (a cluster with EPD_TLS_* set), else plaintext."""
    with sync_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
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


def main(argv: list[str] | None = None) -> int:
    """`python -m services.launch.health [--plaintext] HOST:PORT`: exit 0 when SERVING, over mTLS when `EPD_TLS_*`
    are set unless `--plaintext` (a service's loopback health listener, `EPD_HEALTH_PORT`). The Kubernetes probe
    with TLS on: it imports no torch, so it answers well within a probe's timeout."""
    args = sys.argv[1:] if argv is None else argv
    plaintext = args[:1] == ["--plaintext"]
    args = args[1:] if plaintext else args
    if len(args) != 1:
        print("usage: python -m services.launch.health [--plaintext] HOST:PORT", file=sys.stderr)
        return 2
    ok = check(args[0], tls=None if plaintext else client_from_env(os.environ))
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
