"""uvicorn serving the HTTP API inside the router's own asyncio loop, next to the gRPC server.

Invariants: one process, one loop, so admission, metrics and the cluster view are the objects the
gRPC API uses; uvicorn installs no signal handlers and no logging config of its own (the router's
`run_until_signalled` owns SIGINT/SIGTERM and stops HTTP with everything else); a port that cannot be
bound fails the router's start-up with OSError rather than leaving it half up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version

import uvicorn

from services.common.model_info import ModelInfo
from services.common.tls import TlsFiles, ssl_context
from services.router.config import RouterConfig
from services.router.http_api import Generation, HttpApi, Workers, build_app, served_model_id
from services.router.http_exchange import max_body_bytes
from services.router.metrics import RouterMetrics
from services.router.tokens_api import Preparing, Tokens

log = logging.getLogger(__name__)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for host:port (port 0 picks a free one); OSError naming the address if taken.

    Made with its protocol named (IPPROTO_TCP): asyncio sets TCP_NODELAY only on connections whose socket
    says so, and without it a kept-alive connection's response written in two parts (headers, then the body
    or an SSE event) waited ~40 ms for the client's delayed ACK (Nagle)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from exc
    return sock


async def start_http_server(
    api: HttpApi, host: str, port: int, drain_timeout_s: float, tls_files: TlsFiles | None = None
) -> tuple[int, Callable[[], Awaitable[None]]]:
    """Serve the HTTP API on host:port, over TLS when `tls_files` (re-read on change; client certificates
    required when they name a CA); returns the bound port and an async stop function, which stops accepting
    at once and gives the responses in flight up to `drain_timeout_s` to finish (EPD_DRAIN_TIMEOUT_S, as
    the gRPC streams get) before cancelling them."""
    sock = listen_socket(host, port)
    config = uvicorn.Config(
        build_app(api),
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(drain_timeout_s),
    )
    config.load()
    if tls_files is not None:  # our own context: uvicorn's would never re-read a rotated certificate
        config.ssl = ssl_context(tls_files, require_client_cert=bool(tls_files.ca_file))
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # what Server.serve() sets up before startup()
    await server.startup(sockets=[sock])
    ticker = asyncio.create_task(server.main_loop())  # date header, should_exit
    bound = sock.getsockname()[1]
    scheme = "https" if tls_files is not None else "http"
    log.info("HTTP API (OpenAI-compatible) serving %s on %s:%d, model %r", scheme, host, bound, api.model_id)

    async def stop() -> None:
        server.should_exit = True
        await ticker
        await server.shutdown(sockets=[sock])

    return bound, stop


async def serve_router_http(
    config: RouterConfig,
    info: ModelInfo,
    generation: Generation,
    view: Workers,
    metrics: RouterMetrics,
    prep: Preparing,
) -> Callable[[], Awaitable[None]]:
    """The router's HTTP API on config.host:config.http_port over its shared objects; returns its stop
    function (a no-op when `http_port` is 0, HTTP off)."""
    if not config.http_port:
        return _nothing
    api = HttpApi(
        generation=generation,
        view=view,
        count_invalid=lambda: metrics.requests.add(1, {"outcome": "invalid_argument"}),
        count_invalid_count=lambda: metrics.count_tokens.add(1, {"outcome": "invalid_argument"}),
        tokens=Tokens(info.adapter, prep),
        model_id=served_model_id(info.model_dir),
        max_model_len=info.adapter.max_context,
        request_timeout_s=config.request_timeout_s,
        max_body_bytes=max_body_bytes(config.max_request_bytes),
        max_constraint_bytes=config.structured_max_bytes,
        version=epd_version(),
    )
    _, stop = await start_http_server(api, config.host, config.http_port, config.drain_timeout_s, config.public_tls())
    return stop


def epd_version() -> str:
    """The installed epd package's version ("unknown" when run from a checkout that is not installed)."""
    try:
        return version("epd")
    except PackageNotFoundError:
        return "unknown"


async def _nothing() -> None:
    return None
