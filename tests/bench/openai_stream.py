"""A minimal streaming client for OpenAI-compatible `/v1/chat/completions`: each SSE chunk's arrival and tokens.

HTTP/1.1 on asyncio streams (no third-party client: the same few lines of Python for every server measured, and
little client CPU on a small box), each connection kept open and reused for the next request, as vLLM's benchmark
client (aiohttp's pool) and the OpenAI SDK (httpx's) do: a server's per-connection work is not counted per request.
A chunk's tokens are the growth of its `usage.completion_tokens` when the server sends usage with every chunk
(`stream_options.continuous_usage_stats`, as vLLM does), else its `logprobs.content` entries when present, else one
per chunk with content; the final usage chunk's `completion_tokens` is kept separately (`usage_tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

REFUSALS = (429, 503)
LOOPBACK = ("127.0.0.1", "localhost")


@dataclass
class Outcome:
    """One request: when it was sent (perf_counter seconds), its HTTP status, when each content chunk arrived
    with its token count, and how it ended."""

    sent: float = 0.0
    ended: float = 0.0
    status: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    usage_tokens: int = 0  # completion_tokens of the final usage chunk (0: none sent)
    error: str = ""
    finished: bool = False  # the stream reached [DONE] (or its end) without an error event

    @property
    def refused(self) -> bool:
        return self.status in REFUSALS

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finished and not self.error

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.chunks)


@dataclass(frozen=True)
class Endpoint:
    """A server's `/v1/chat/completions` on the loopback interface."""

    host: str
    port: int
    prefix: str  # the path before /v1 ("" mostly)
    api_key: str = ""
    _idle: list[_Connection] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def parse(cls, base_url: str, api_key: str = "") -> Endpoint:
        """``http://127.0.0.1:PORT[/prefix][/v1]``; raises ValueError for another host or scheme (this bench
        only measures servers on this machine)."""
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.port is None:
            raise ValueError(f"{base_url!r}: only http://127.0.0.1:PORT targets are measured")
        prefix = parts.path.rstrip("/")
        prefix = prefix.removesuffix("/v1")
        return cls("127.0.0.1", parts.port, prefix, api_key)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.prefix}"

    def models(self, timeout_s: float = 10.0) -> list[str]:
        """The ids `GET /v1/models` lists."""
        import urllib.request

        request = urllib.request.Request(f"{self.url}/v1/models", headers=self._auth())
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return [m["id"] for m in json.load(response).get("data", [])]

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def stream(self, body: bytes, out: Outcome) -> None:
        """POST ``body`` (a JSON chat request with ``"stream": true``) and record into ``out`` as it arrives, on an
        idle connection of this endpoint's when one is open (a new one when the server had closed it before
        answering), else a new one; the connection is kept for the next request when the answer ended cleanly."""
        out.sent = time.perf_counter()
        connection = self._take_idle()
        if connection is not None:
            try:
                await self._exchange(connection, body, out)
            except _ClosedBeforeAnswer:
                connection.close()
                connection = None
        if connection is None:
            connection = _Connection(*await asyncio.open_connection(self.host, self.port))
            await self._exchange(connection, body, out)

    def close_idle(self) -> None:
        """Close the connections kept for a next request."""
        while self._idle:
            self._idle.pop().close()

    def _take_idle(self) -> _Connection | None:
        loop = asyncio.get_running_loop()
        while self._idle:
            connection = self._idle.pop()
            if connection.loop is loop and not connection.reader.at_eof():
                return connection
            connection.close()
        return None

    async def _exchange(self, connection: _Connection, body: bytes, out: Outcome) -> None:
        reader, writer = connection.reader, connection.writer
        reusable = False
        try:
            head = [
                f"POST {self.prefix}/v1/chat/completions HTTP/1.1",
                f"Host: {self.host}:{self.port}",
                "Content-Type: application/json",
                "Accept: text/event-stream",
                f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in self._auth().items()),
            ]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            try:
                await writer.drain()
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise _ClosedBeforeAnswer(str(exc)) from exc
            out.status, headers = await _read_head(reader)
            if out.status != 200:
                text = b"".join([piece async for piece in _body(reader, headers)])
                out.ended = time.perf_counter()
                out.error = f"HTTP {out.status}: {text[:200].decode(errors='replace')}"
            else:
                await _read_events(reader, headers, out)
                out.ended = time.perf_counter()
            reusable = "close" not in headers.get("connection", "").lower() and _delimited(headers)
        finally:
            if reusable:
                self._idle.append(connection)
            else:
                connection.close()


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop has closed
            self.writer.close()


class _ClosedBeforeAnswer(ConnectionError):
    """A kept connection the server had closed: nothing of the request was answered (safe to send again)."""


def _delimited(headers: dict[str, str]) -> bool:
    """The body's end is marked (chunked or sized), so the connection can carry another request after it."""
    return "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        status_line = await reader.readline()
    except ConnectionResetError:
        status_line = b""
    if not status_line:
        raise _ClosedBeforeAnswer("the server closed the connection before answering")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive: chunked, sized, or until the connection closes."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers, up to the blank line
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readline()
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0 and (piece := await reader.read(min(left, 1 << 16))):
            left -= len(piece)
            yield piece
    else:
        while piece := await reader.read(1 << 16):
            yield piece


async def _read_events(reader: asyncio.StreamReader, headers: dict[str, str], out: Outcome) -> None:
    buffer = b""
    async for piece in _body(reader, headers):
        now = time.perf_counter()
        buffer += piece.replace(b"\r\n", b"\n")
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    out.finished = not out.error
                elif not out.finished:
                    _take_chunk(json.loads(data), now, out)
    out.finished = not out.error  # the body read to its end: the connection may carry the next request


def _take_chunk(chunk: dict[str, Any], now: float, out: Outcome) -> None:
    if "error" in chunk:
        out.error = str(chunk["error"])[:200]
        return
    usage = chunk.get("usage") or {}
    choices = chunk.get("choices") or []
    if not choices:  # the final usage chunk
        out.usage_tokens = int(usage.get("completion_tokens") or 0)
        return
    choice = choices[0]
    content = (choice.get("delta") or {}).get("content") or ""
    if "completion_tokens" in usage:
        k = int(usage["completion_tokens"]) - out.tokens
    elif (choice.get("logprobs") or {}).get("content"):
        k = len(choice["logprobs"]["content"])
    else:
        k = 1 if content else 0
    if k > 0:
        out.chunks.append((now, k))
