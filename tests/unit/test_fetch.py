"""The router's safe media fetcher against a real HTTP server on loopback (no network mocks, no internet).

Refusals are checked twice: the reason and message, and that the recording server never saw a
connection. Public addresses appear only in the classifier table; nothing here connects to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, parse_qs, quote, urlsplit

import pytest

from services.router.fetch import FetchError, FetchPolicy, fetch_media

BLOB = os.urandom(300_000)
TEST = FetchPolicy(allow_loopback_for_tests=True, total_timeout_s=5.0)


@dataclass
class Seen:
    """What the server accepted: one entry per TCP connection, and the (path, Host) of each request."""

    connections: list[str] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    server_names: list[str | None] = field(default_factory=list)


class LoopbackServer:
    """A tiny HTTP/1.1 server on 127.0.0.1 (and ::1, same port, when the host has it) in its own thread."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.seen = Seen()
        self._tls = tls
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(lambda loop, context: None)  # failed TLS handshakes are expected
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._tasks: set[asyncio.Task[None]] = set()
        sock4 = socket.create_server(("127.0.0.1", 0))
        self.port = sock4.getsockname()[1]
        self._socks = [sock4]
        with contextlib.suppress(OSError):
            self._socks.append(socket.create_server(("::1", self.port), family=socket.AF_INET6))
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(5)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _serve(self) -> None:
        self._servers = [await asyncio.start_server(self._handle, sock=s, ssl=self._tls) for s in self._socks]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        self.seen.connections.append(str(writer.get_extra_info("peername")))
        try:
            if await reader.readexactly(4) != b"GET ":  # e.g. a TLS ClientHello
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                return
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            target = head[0].split(" ")[0]
            host = next((h.split(":", 1)[1].strip() for h in head[1:] if h.lower().startswith("host:")), "")
            self.seen.requests.append((target, host))
            await self._respond(urlsplit(target), writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _respond(self, target: SplitResult, writer: asyncio.StreamWriter) -> None:
        path, query = target.path, parse_qs(target.query)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
        if path == "/image":
            writer.write(head + b"Content-Length: %d\r\n\r\n" % len(BLOB) + BLOB)
        elif path == "/eof":
            writer.write(head + b"\r\n" + BLOB)
        elif path == "/chunked":
            pieces = [BLOB[i : i + 70_000] for i in range(0, len(BLOB), 70_000)]
            body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Trailer: 1\r\n\r\n"
            writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n" + body)
        elif path == "/redirect":
            writer.write(b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % query["to"][0].encode())
        elif path == "/slow":
            writer.write(head + b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
            await asyncio.sleep(30)
        elif path == "/huge":
            writer.write(head + b"Content-Length: 1000000000\r\n\r\n")
            await asyncio.sleep(30)
        elif path == "/endless":
            writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"10000\r\n" + bytes(65536) + b"\r\n")
                await writer.drain()
        elif path == "/smuggle":
            writer.write(head + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        elif path == "/badchunk":
            writer.write(head + b"Transfer-Encoding: chunked\r\n\r\n0x10\r\n")
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            for task in list(self._tasks):
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    srv = LoopbackServer()
    yield srv
    srv.close()


def refused(url: str, policy: FetchPolicy) -> FetchError:
    with pytest.raises(FetchError) as info:
        asyncio.run(fetch_media(url, policy))
    return info.value


def assert_untouched(server: LoopbackServer) -> None:
    time.sleep(0.02)  # let the server thread record anything the kernel had accepted
    assert server.seen.connections == []


DEFAULT_REFUSALS = [
    ("http://127.0.0.1:{port}/image", "scheme", "'http' is not allowed"),
    ("https://127.0.0.1:{port}/image", "address", "loopback"),
    ("https://10.0.0.1/", "address", "private"),
    ("https://172.16.5.4/", "address", "private"),
    ("https://192.168.1.1/", "address", "private"),
    ("https://169.254.169.254/latest/meta-data", "address", "link-local"),
    ("https://[::1]:{port}/image", "address", "loopback"),
    ("https://[::ffff:127.0.0.1]:{port}/image", "address", "IPv4-mapped"),
    ("https://0.0.0.0:{port}/image", "address", "unspecified"),
    ("https://[::]:{port}/image", "address", "unspecified"),
    ("https://2130706433/", "address", "decimal, octal, hex"),
    ("https://0177.0.0.1/", "address", "canonical dotted-quad"),
    ("https://0x7f.0.0.1/", "address", "canonical dotted-quad"),
    ("https://127.1:{port}/", "address", "canonical dotted-quad"),
    ("https://localhost:{port}/image", "address", "localhost resolves to it"),
    ("file:///etc/passwd", "scheme", "'file'"),
    ("ftp://127.0.0.1:{port}/image", "scheme", "'ftp'"),
    ("https://user@127.0.0.1:{port}/image", "url", "credentials"),
    ("https://user:pw@example.com/", "url", "credentials"),
    ("https://[fe80::1%25eth0]/", "url", "zone"),
    ("https://127.0.0.1:0/", "url", "bad port"),
    ("https://exa mple.com/", "url", "printable ASCII"),
    ("https://%31%32%37.0.0.1/", "url", "malformed host"),
]


@pytest.mark.parametrize(("template", "reason", "words"), DEFAULT_REFUSALS)
def test_default_policy_refuses_without_connecting(
    server: LoopbackServer, template: str, reason: str, words: str
) -> None:
    error = refused(template.format(port=server.port), FetchPolicy())
    assert (error.reason, words in str(error)) == (reason, True), str(error)
    assert_untouched(server)


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("http://10.0.0.1/", "address"),
        ("http://192.168.0.10:{port}/", "address"),
        ("http://127.0.0.2:{port}/image", "address"),
        ("http://[::ffff:127.0.0.1]:{port}/image", "address"),
        ("http://0.0.0.0:{port}/image", "address"),
        ("http://2130706433:{port}/image", "address"),
        ("http://93.184.216.34/", "scheme"),  # plain http is for the loopback test server only
        ("http://user@127.0.0.1:{port}/image", "url"),
    ],
)
def test_test_allowance_is_loopback_only(server: LoopbackServer, template: str, reason: str) -> None:
    assert refused(template.format(port=server.port), TEST).reason == reason
    assert_untouched(server)


@pytest.mark.parametrize("path", ["/image", "/eof", "/chunked"])
def test_fetches_byte_exact(server: LoopbackServer, path: str) -> None:
    assert asyncio.run(fetch_media(server.url(path + "#frag"), TEST)) == BLOB
    assert server.seen.requests == [(path, f"127.0.0.1:{server.port}")]


class CountingLoop(asyncio.SelectorEventLoop):
    """An ordinary event loop that records each name it is asked to resolve."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[object] = []

    async def getaddrinfo(self, host, *args, **kwargs):  # type: ignore[no-untyped-def]  # noqa: ANN001
        self.lookups.append(host)
        return await super().getaddrinfo(host, *args, **kwargs)


def test_name_is_resolved_once_and_host_header_kept(server: LoopbackServer) -> None:
    loop = CountingLoop()
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        body = runner.run(fetch_media(server.url("/image", host="localhost"), TEST))
    assert body == BLOB
    assert loop.lookups == ["localhost"]  # the connection went to the pinned address, not the name
    assert server.seen.requests == [("/image", f"localhost:{server.port}")]


def redirect_url(server: LoopbackServer, to: str) -> str:
    return server.url("/redirect?to=" + quote(to, safe=""))


def test_redirect_refused_by_default(server: LoopbackServer) -> None:
    error = refused(redirect_url(server, server.url("/image")), TEST)
    assert error.reason == "redirect" and "at most 0 redirect" in str(error)
    assert len(server.seen.connections) == 1


@pytest.mark.parametrize("to", ["{image}", "/image"])
def test_redirect_followed_when_allowed(server: LoopbackServer, to: str) -> None:
    policy = FetchPolicy(allow_loopback_for_tests=True, max_redirects=1)
    assert asyncio.run(fetch_media(redirect_url(server, to.format(image=server.url("/image"))), policy)) == BLOB
    assert len(server.seen.connections) == 2


@pytest.mark.parametrize(
    ("to", "reason"),
    [
        ("http://10.0.0.1/", "address"),
        ("http://192.168.1.1/", "address"),
        ("http://172.31.0.1/", "address"),
        ("http://169.254.169.254/latest/meta-data", "address"),
        ("http://100.64.0.1/", "address"),
        ("http://127.0.0.2:{port}/image", "address"),
        ("http://[::ffff:127.0.0.1]:{port}/image", "address"),
        ("http://0x7f.0.0.1:{port}/image", "address"),
        ("file:///etc/passwd", "scheme"),
        ("http://93.184.216.34/", "scheme"),
        ("{chain}", "redirect"),
    ],
)
def test_redirect_target_rechecked(server: LoopbackServer, to: str, reason: str) -> None:
    policy = FetchPolicy(allow_loopback_for_tests=True, max_redirects=1)
    target = to.format(port=server.port, chain=redirect_url(server, server.url("/image")))
    assert refused(redirect_url(server, target), policy).reason == reason
    assert len(server.seen.connections) == (2 if reason == "redirect" else 1)


def test_slow_server_hits_total_timeout(server: LoopbackServer) -> None:
    start = time.monotonic()
    error = refused(server.url("/slow"), FetchPolicy(allow_loopback_for_tests=True, total_timeout_s=0.5))
    elapsed = time.monotonic() - start
    # The policy's bound ended it (the server's 30 s of silence ends in a short body, another refusal) and not
    # before the bound; a busy box can only make it later.
    assert error.reason == "timeout" and "within 0.5 s" in str(error), error
    assert elapsed > 0.45, elapsed


@pytest.mark.parametrize(("path", "cap"), [("/endless", 1 << 20), ("/eof", 100_000), ("/chunked", 100_000)])
def test_body_over_cap_while_streaming(server: LoopbackServer, path: str, cap: int) -> None:
    error = refused(server.url(path), FetchPolicy(allow_loopback_for_tests=True, max_bytes=cap))
    assert error.reason == "too_large" and str(cap) in str(error)


def test_content_length_over_cap_refused_before_body(server: LoopbackServer) -> None:
    error = refused(server.url("/huge"), TEST)
    # The server never sends the body: a fetch that waited for it would end by its timeout instead.
    assert error.reason == "too_large" and "1000000000 bytes" in str(error)


@pytest.mark.parametrize(
    ("path", "reason", "words"),
    [
        ("/missing", "http_status", "404 Not Found"),
        ("/smuggle", "protocol", "Transfer-Encoding"),
        ("/badchunk", "protocol", "chunk size"),
    ],
)
def test_bad_responses(server: LoopbackServer, path: str, reason: str, words: str) -> None:
    error = refused(server.url(path), TEST)
    assert error.reason == reason and words in str(error), str(error)


def test_tls_failure_and_closed_port(server: LoopbackServer) -> None:
    assert refused(f"https://127.0.0.1:{server.port}/image", TEST).reason == "tls"  # plain server, no TLS
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    assert refused(f"http://127.0.0.1:{closed_port}/", TEST).reason == "connect"


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[LoopbackServer]:
    """A TLS server on loopback with a self-signed certificate for "localhost" (made by the openssl CLI)."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "the openssl command is required to make the test certificate"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    srv = LoopbackServer(tls=ctx)
    ctx.sni_callback = lambda sock, name, context: srv.seen.server_names.append(name)  # type: ignore[assignment]
    yield srv
    srv.close()


def test_tls_verifies_the_original_host_name(tls_server: LoopbackServer) -> None:
    error = refused(f"https://localhost:{tls_server.port}/image", TEST)
    assert error.reason == "tls" and "self-signed" in str(error), str(error)
    assert tls_server.seen.server_names == ["localhost"]  # SNI carries the name, the socket the pinned address
    assert tls_server.seen.requests == []  # nothing was sent over the unverified channel


def test_allowlist_refuses_other_hosts_before_resolving() -> None:
    policy = FetchPolicy(allowed_hosts=frozenset({"cdn.example.com", "*.img.example.com"}))
    assert refused("https://127.0.0.1/", policy).reason == "host_not_allowed"
    assert refused("https://evil.example/", policy).reason == "host_not_allowed"
