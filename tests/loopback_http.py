"""A throwaway HTTP server on loopback that serves fixed bytes: the media URL of a test."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(data: bytes, path: str = "/cat.png", asked: list[str] | None = None) -> Iterator[str]:
    """Serve ``data`` at ``http://127.0.0.1:<free port><path>`` (any GET path answers) until the block ends;
    each path asked for is appended to ``asked`` when given."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if asked is not None:
                asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}{path}"
    finally:
        server.shutdown()
        server.server_close()
