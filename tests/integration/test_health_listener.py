"""The loopback health listener (`EPD_HEALTH_PORT`) of a real router process whose public port a pod's own
certificate cannot probe (its pair and its client CA are another CA's).

The probe command the chart runs reads SERVING there while the port's health does, the listener serves health
alone and on 127.0.0.1 only, and a drain shows as NOT_SERVING on both at once (the pod leaves the endpoints as
the port says it drains)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.rpc.epd.v1 import generation_pb2, generation_pb2_grpc
from services.launch.health import wait_healthy
from services.launch.local import Process, free_port, spawn
from tests.certs import CertAuthority, Pair
from tests.redis_server import RedisServer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DEADLINE_S = 120.0  # only a hang misses it


@dataclass(frozen=True)
class Router:
    process: Process
    health_port: int
    public_ca: Path
    public_client: Pair
    pod_env: dict[str, str]  # the cluster's EPD_TLS_* files, as a pod's probe sees them

    def public_channel(self) -> grpc.Channel:
        """A public client of the router's gRPC port: its CA, and a client certificate it signed."""
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.public_ca.read_bytes(),
            private_key=self.public_client.key_file.read_bytes(),
            certificate_chain=self.public_client.cert_file.read_bytes(),
        )
        return grpc.secure_channel(self.process.address, credentials)

    def probe(self, *args: str) -> subprocess.CompletedProcess:
        """The chart's probe command (`python -m services.launch.health ...`) in the pod's environment."""
        command = [sys.executable, "-m", "services.launch.health", *args]
        return subprocess.run(command, env={**os.environ, **self.pod_env}, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def router(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    folder = tmp_path_factory.mktemp("health-listener")
    cluster, public = CertAuthority.create(folder, "cluster"), CertAuthority.create(folder, "public")
    pod, public_pair, public_client = (
        cluster.issue(folder, "services"),
        public.issue(folder, "router-public"),
        public.issue(folder, "public-client"),
    )
    pod_env = {
        "EPD_TLS_CERT_FILE": str(pod.cert_file),
        "EPD_TLS_KEY_FILE": str(pod.key_file),
        "EPD_TLS_CA_FILE": str(cluster.cert_file),
    }
    health_port = free_port()
    env = {
        **pod_env,
        "EPD_MODEL": str(tiny_model_dir),
        "EPD_REDIS_URL": redis_server.url,
        "EPD_HTTP_PORT": "0",
        "EPD_PUBLIC_TLS_CERT_FILE": str(public_pair.cert_file),
        "EPD_PUBLIC_TLS_KEY_FILE": str(public_pair.key_file),
        "EPD_PUBLIC_TLS_CLIENT_CA_FILE": str(public.cert_file),
        "EPD_HEALTH_PORT": str(health_port),
    }
    process = spawn("router", free_port(), free_port(), env, folder)
    try:
        wait_healthy(f"127.0.0.1:{health_port}", DEADLINE_S, alive=lambda: process.popen.poll() is None)
        yield Router(process, health_port, public.cert_file, public_client, pod_env)
    finally:
        if process.popen.poll() is None:
            process.popen.terminate()
        process.popen.wait(timeout=60)


def test_the_probe_reads_the_ports_health_where_the_pods_certificate_cannot(router: Router) -> None:
    with router.public_channel() as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == SERVING
    probe = router.probe("--plaintext", f"127.0.0.1:{router.health_port}")
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING"), probe.stderr
    mtls = router.probe(router.process.address)  # the pod's own pair against the public port: refused
    assert (mtls.returncode, mtls.stdout.strip()) == (1, "NOT SERVING")


def test_the_listener_serves_health_alone_on_loopback_only(router: Router) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{router.health_port}") as channel:
        with pytest.raises(grpc.RpcError) as generation:
            generation_pb2_grpc.GenerationStub(channel).CountTokens(generation_pb2.GenerateRequest(), timeout=30)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
        )
        with pytest.raises(grpc.RpcError) as listing:
            next(reflection)
    assert generation.value.code() == listing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.2", router.health_port))  # another loopback address: bound to 127.0.0.1 alone


def test_a_drain_is_not_serving_on_the_port_and_the_listener_alike(router: Router) -> None:
    """Last in the module: it stops the router (SIGTERM, as the kubelet does)."""
    with router.public_channel() as public, grpc.insecure_channel(f"127.0.0.1:{router.health_port}") as loopback:
        watches = [
            health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
            for channel in (public, loopback)
        ]
        assert [next(watch).status for watch in watches] == [SERVING, SERVING]
        router.process.popen.send_signal(signal.SIGTERM)
        assert [next(watch).status for watch in watches] == [NOT_SERVING, NOT_SERVING]
    assert router.process.popen.wait(timeout=DEADLINE_S) == 0
