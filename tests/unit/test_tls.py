"""services/common/tls.py with certificates made here: mTLS refusals, and certificates re-read when rotated.

Servers are real gRPC (and TLS socket) servers on 127.0.0.1 in this process; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_server
from services.common.tls import ClientTls, Dialer, TlsFiles, server_credentials, ssl_context, sync_channel
from services.launch.health import check
from tests.certs import CertAuthority, Pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("pki")
    cluster, other = CertAuthority.create(root, "cluster"), CertAuthority.create(root, "other")
    return {
        "root": root,
        "cluster": cluster,
        "other": other,
        "server": cluster.issue(root, "server"),
        "client": cluster.issue(root, "client"),
        "rogue": other.issue(root, "rogue"),
    }


def files(pair: Pair, ca: CertAuthority) -> TlsFiles:
    return TlsFiles(str(pair.cert_file), str(pair.key_file), str(ca.cert_file))


def install(pair: Pair, folder: Path) -> Pair:
    """Copy a pair to the fixed names a server reads (atomic rename, like a Secret update)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = Pair(folder / "tls.crt", folder / "tls.key")
    for source, target in ((pair.cert_file, out.cert_file), (pair.key_file, out.key_file)):
        shutil.copy(source, f"{target}.new")
        os.replace(f"{target}.new", target)
    return out


class Server:
    """A gRPC server with health only, on its own loop thread."""

    def __init__(self, credentials: grpc.ServerCredentials | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = self.call(grpc_server.start_server("127.0.0.1", 0, [], credentials))
        self.address = f"127.0.0.1:{self.running.port}"

    def call(self, coro):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.call(self.running.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def mtls_server(pki: dict, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    served = install(pki["server"], tmp_path / "served")
    server = Server(server_credentials(files(served, pki["cluster"]), require_client_cert=True))
    yield server, tmp_path / "served"
    server.stop()


def plaintext_health(address: str) -> bool:
    return check(address, timeout_s=2.0)


def test_mtls_server_answers_only_clients_of_its_ca(pki: dict, mtls_server: tuple[Server, Path]) -> None:
    server, _ = mtls_server
    good = ClientTls(files(pki["client"], pki["cluster"]))
    assert check(server.address, tls=good)
    assert not plaintext_health(server.address), "a plaintext client must fail the handshake"
    trusts_other = ClientTls(
        TlsFiles(str(pki["client"].cert_file), str(pki["client"].key_file), str(pki["other"].cert_file))
    )
    assert not check(server.address, tls=trusts_other), "a client that trusts another CA must refuse the server"
    rogue_client = ClientTls(files(pki["rogue"], pki["cluster"]))
    assert not check(server.address, tls=rogue_client), "a client certificate of another CA must be refused"
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki["cluster"].cert_file.read_bytes())
    with grpc.secure_channel(server.address, no_cert) as channel, pytest.raises(grpc.RpcError) as caught:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_server_rereads_a_rotated_certificate(pki: dict, mtls_server: tuple[Server, Path]) -> None:
    server, folder = mtls_server
    client = ClientTls(files(pki["client"], pki["cluster"]))
    assert check(server.address, tls=client)
    install(pki["rogue"], folder)  # the server now presents a certificate of the other CA
    assert not check(server.address, tls=client), "the new certificate (another CA) was not picked up"
    install(pki["server"], folder)
    assert check(server.address, tls=client)


def test_dialer_makes_new_channels_after_client_files_change(
    pki: dict, mtls_server: tuple[Server, Path], tmp_path: Path
) -> None:
    server, _ = mtls_server
    mine = install(pki["client"], tmp_path / "client")
    tls = ClientTls(files(mine, pki["cluster"]))
    tls.check_every_s = 0.0
    dialer = Dialer(tls)

    async def ask(channel: grpc.aio.Channel) -> int:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        return reply.status

    async def scenario() -> None:
        first = dialer.channel(server.address)
        assert dialer.channel(server.address) is first
        assert await ask(first) == health_pb2.HealthCheckResponse.SERVING
        install(pki["rogue"], tmp_path / "client")
        second = dialer.channel(server.address)
        assert second is not first and tls.version == 1
        with pytest.raises(grpc.aio.AioRpcError):  # the rotated-in certificate is of another CA: refused
            await ask(second)
        await dialer.close()

    asyncio.run(scenario())


def test_plaintext_stays_available_without_tls(pki: dict) -> None:
    server = Server(None)
    try:
        assert plaintext_health(server.address)
        assert not check(server.address, tls=ClientTls(files(pki["client"], pki["cluster"])))
        with sync_channel(server.address, None) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def _tls_hello(port: int, cafile: Path) -> bytes:
    context = ssl.create_default_context(cafile=str(cafile))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        return conn.recv(5)


def test_http_ssl_context_rereads_a_rotated_certificate(pki: dict, tmp_path: Path) -> None:
    served = install(pki["server"], tmp_path / "http")
    context = ssl_context(TlsFiles(str(served.cert_file), str(served.key_file)), require_client_cert=False)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(times: int) -> None:
        for _ in range(times):
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.sendall(b"hello")
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, args=(3,), daemon=True)
    thread.start()
    try:
        assert _tls_hello(port, pki["cluster"].cert_file) == b"hello"
        install(pki["rogue"], tmp_path / "http")
        with pytest.raises(ssl.SSLError):
            _tls_hello(port, pki["cluster"].cert_file)
        assert _tls_hello(port, pki["other"].cert_file) == b"hello"
    finally:
        thread.join(10)
        listener.close()


def test_http_ssl_context_can_require_client_certificates(pki: dict, tmp_path: Path) -> None:
    served = install(pki["server"], tmp_path / "http-mtls")
    files_ = TlsFiles(str(served.cert_file), str(served.key_file), str(pki["cluster"].cert_file))
    context = ssl_context(files_, require_client_cert=True)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(times: int) -> None:
        for _ in range(times):
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.sendall(b"hello")
            except (ssl.SSLError, OSError):
                pass

    def hello(pair: Pair | None) -> bytes:
        client = ssl.create_default_context(cafile=str(pki["cluster"].cert_file))
        if pair is not None:
            client.load_cert_chain(str(pair.cert_file), str(pair.key_file))
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
                client.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
            ):
                return conn.recv(5)
        except (ssl.SSLError, ConnectionError):
            return b""  # refused during or right after the handshake (TLS 1.3 checks the client late)

    thread = threading.Thread(target=serve, args=(3,), daemon=True)
    thread.start()
    try:
        assert hello(pki["client"]) == b"hello"
        for pair in (None, pki["rogue"]):  # no certificate; one of another CA
            assert hello(pair) == b""
    finally:
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("command", [["-m", "services.launch.health"], ["-m", "services.cli", "health"]])
def test_health_probes_over_mtls_from_the_tls_variables(
    pki: dict, mtls_server: tuple[Server, Path], command: list[str]
) -> None:
    """What the chart's probes run with TLS on (`python -m services.launch.health 127.0.0.1:<port>`), and
    `epd health`, with the pod's EPD_TLS_* files."""
    server, _ = mtls_server
    command = [sys.executable, *command, server.address]
    tls_env = {
        "EPD_TLS_CERT_FILE": str(pki["client"].cert_file),
        "EPD_TLS_KEY_FILE": str(pki["client"].key_file),
        "EPD_TLS_CA_FILE": str(pki["cluster"].cert_file),
        "EPD_TLS_SERVER_NAME": "localhost",
    }
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_TLS_")}
    ok = subprocess.run(command, env={**plain_env, **tls_env}, capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    plain = subprocess.run(command, env=plain_env, capture_output=True, text=True, timeout=60)
    assert (plain.returncode, plain.stdout.strip()) == (1, "NOT SERVING")
