"""The router's safe media fetcher: `fetch_media(url, policy)` returns the body bytes or raises FetchError.

Invariants (see docs/fetch.md):
- Every hop (the first URL and each redirect target) goes through `parse_target`, one name
  resolution, and the address check of EVERY resolved address before any connection is opened.
- The connection goes to one of those checked addresses, never to a name: nothing resolves the host
  a second time, so DNS rebinding cannot swap the destination. TLS still verifies the certificate
  against, and sends SNI for, the original host name.
- No more than `policy.max_bytes` body bytes are ever buffered; a larger Content-Length is refused
  before the body is read. The whole fetch, redirects included, ends within `total_timeout_s`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin

from services.router.fetch_policy import (
    FetchError,
    FetchPolicy,
    FetchReason,
    IPAddress,
    Target,
    check_resolved,
    classify_address,
    parse_target,
)

__all__ = ["FetchError", "FetchPolicy", "FetchReason", "classify_address", "fetch_media"]

MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 100
REDIRECTS = frozenset({301, 302, 303, 307, 308})
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-9][0-9]{2})(?: ([^\r\n]*))?")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(.*?)[ \t]*")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
_READ_SIZE = 64 << 10


@dataclass(frozen=True)
class ResponseHead:
    """Status and headers of one response; header names are lower case, repeated headers keep every value."""

    status: int
    reason: str
    headers: dict[str, list[str]]


@dataclass(frozen=True)
class Hop:
    """The outcome of one request: the body, or the Location of a redirect (exactly one is set)."""

    body: bytes | None = None
    location: str | None = None


async def fetch_media(url: str, policy: FetchPolicy) -> bytes:
    """Fetch `url` under `policy`; returns the whole body (at most `policy.max_bytes` bytes).

    Raises FetchError whose `reason` is one of FetchReason; the message is fit for the client.
    """
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await _follow(url, policy)
    except TimeoutError:
        raise FetchError(f"fetch did not finish within {policy.total_timeout_s:g} s", FetchReason.TIMEOUT) from None


async def _follow(url: str, policy: FetchPolicy) -> bytes:
    """Fetch, following up to `policy.max_redirects` redirects; every hop is parsed, resolved and checked anew."""
    current = url
    for hop_index in range(policy.max_redirects + 1):
        target = parse_target(current, policy)
        addresses = await _resolve(target)
        check_resolved(target, addresses, policy)
        hop = await _fetch_once(target, addresses, policy)
        if hop.body is not None:
            return hop.body
        if hop_index == policy.max_redirects:
            raise FetchError(
                f"redirect to {(hop.location or '')[:200]!r} refused: at most "
                f"{policy.max_redirects} redirect(s) are followed",
                FetchReason.REDIRECT,
            )
        current = urljoin(target.url, hop.location or "")
    raise FetchError("redirect limit reached", FetchReason.REDIRECT)  # unreachable: the loop returns or raises


async def _resolve(target: Target) -> list[IPAddress]:
    """The host's addresses, resolved exactly once (an IP literal is not resolved at all)."""
    if target.literal is not None:
        return [target.literal]
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchError(f"cannot resolve host {target.host!r}: {exc}", FetchReason.DNS) from None
    addresses: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]))
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise FetchError(f"host {target.host!r} has no addresses", FetchReason.DNS)
    return addresses


async def _connect(
    target: Target, addresses: list[IPAddress], policy: FetchPolicy
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection to the first checked address that answers; TLS verifies the original host name."""
    tls = await policy.tls_context() if target.scheme == "https" else None
    failure = FetchError(f"cannot connect to {target.host!r}", FetchReason.CONNECT)
    for ip in addresses:
        try:
            async with asyncio.timeout(policy.connect_timeout_s):
                return await asyncio.open_connection(
                    str(ip), target.port, ssl=tls, server_hostname=target.host if tls else None, limit=MAX_HEAD_BYTES
                )
        except ssl.SSLError as exc:
            raise _tls_error(target, exc) from None
        except TimeoutError:
            failure = FetchError(
                f"connecting to {target.host!r} ({ip}) took longer than {policy.connect_timeout_s:g} s",
                FetchReason.TIMEOUT,
            )
        except OSError as exc:
            failure = FetchError(
                f"cannot connect to {target.host!r} ({ip}): {exc.strerror or exc}", FetchReason.CONNECT
            )
    raise failure


def _tls_error(target: Target, exc: ssl.SSLError) -> FetchError:
    detail = getattr(exc, "verify_message", None) or exc.reason or str(exc)
    return FetchError(f"TLS with {target.host!r} failed: {detail}", FetchReason.TLS)


async def _fetch_once(target: Target, addresses: list[IPAddress], policy: FetchPolicy) -> Hop:
    reader, writer = await _connect(target, addresses, policy)
    try:
        request = (
            f"GET {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\nUser-Agent: epd-fetch/1\r\n"
            "Accept: */*\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n"
        )
        writer.write(request.encode("ascii"))
        await writer.drain()
        head = await _read_head(reader)
        return await _handle(reader, head, target, policy)
    except ssl.SSLError as exc:
        raise _tls_error(target, exc) from None
    except asyncio.IncompleteReadError:
        raise FetchError(f"{target.host!r} closed the connection mid-response", FetchReason.PROTOCOL) from None
    except asyncio.LimitOverrunError:
        raise FetchError(f"{target.host!r} sent an over-long header line", FetchReason.PROTOCOL) from None
    except OSError as exc:
        raise FetchError(f"connection to {target.host!r} failed: {exc.strerror or exc}", FetchReason.CONNECT) from None
    finally:
        writer.transport.abort()


async def _handle(reader: asyncio.StreamReader, head: ResponseHead, target: Target, policy: FetchPolicy) -> Hop:
    if head.status in REDIRECTS:
        locations = head.headers.get("location", [])
        if len(locations) != 1 or not locations[0]:
            raise FetchError(
                f"{target.host!r} sent a {head.status} redirect without one Location", FetchReason.PROTOCOL
            )
        return Hop(location=locations[0])
    if not 200 <= head.status < 300:
        raise FetchError(f"{target.host!r} answered {head.status} {head.reason}".rstrip(), FetchReason.HTTP_STATUS)
    return Hop(body=await _read_body(reader, head.headers, policy.max_bytes))


async def _line(reader: asyncio.StreamReader) -> bytes:
    return (await reader.readuntil(b"\n")).removesuffix(b"\n").removesuffix(b"\r")


async def _read_head(reader: asyncio.StreamReader) -> ResponseHead:
    """Read the status line and headers, skipping interim 1xx responses; everything is size-capped."""
    for _ in range(5):
        status_line = await _line(reader)
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise FetchError("response is not HTTP/1.x", FetchReason.PROTOCOL)
        headers = await _read_fields(reader)
        status = int(match.group(1))
        if status >= 200 or status == 101:
            return ResponseHead(status, (match.group(2) or b"").decode("latin-1"), headers)
    raise FetchError("too many interim (1xx) responses", FetchReason.PROTOCOL)


async def _read_fields(reader: asyncio.StreamReader) -> dict[str, list[str]]:
    """Header (or trailer) fields up to the blank line; obsolete line folding is refused."""
    fields: dict[str, list[str]] = {}
    total = 0
    for _ in range(MAX_HEADERS + 1):
        line = await _line(reader)
        total += len(line)
        if not line:
            return fields
        match = _HEADER_LINE.fullmatch(line)
        if match is None or total > MAX_HEAD_BYTES:
            raise FetchError("malformed or over-long response header", FetchReason.PROTOCOL)
        fields.setdefault(match.group(1).decode("ascii").lower(), []).append(match.group(2).decode("latin-1"))
    raise FetchError(f"more than {MAX_HEADERS} response headers", FetchReason.PROTOCOL)


def _listed(values: list[str]) -> list[str]:
    return [item.strip().lower() for value in values for item in value.split(",")]


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, list[str]], cap: int) -> bytes:
    """The body framed by Transfer-Encoding: chunked, Content-Length, or the connection's end; at most `cap`."""
    encodings, lengths = headers.get("transfer-encoding"), headers.get("content-length")
    if encodings is not None:
        if lengths is not None or _listed(encodings) != ["chunked"]:
            raise FetchError(f"unsupported framing: Transfer-Encoding {encodings}", FetchReason.PROTOCOL)
        return await _read_chunked(reader, cap)
    if lengths is not None:
        values = set(_listed(lengths))
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise FetchError(f"bad Content-Length {lengths}", FetchReason.PROTOCOL)
        length = int(values.pop())
        if length > cap:
            raise FetchError(f"body of {length} bytes is above the {cap}-byte limit", FetchReason.TOO_LARGE)
        return await reader.readexactly(length)
    body = bytearray()
    while chunk := await reader.read(_READ_SIZE):
        body += chunk
        if len(body) > cap:
            raise FetchError(f"body is above the {cap}-byte limit", FetchReason.TOO_LARGE)
    return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader, cap: int) -> bytes:
    body = bytearray()
    while True:
        size_text = (await _line(reader)).partition(b";")[0].strip(b" \t")
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise FetchError("malformed chunk size", FetchReason.PROTOCOL)
        size = int(size_text, 16)
        if size == 0:
            await _read_fields(reader)  # trailers, discarded
            return bytes(body)
        if len(body) + size > cap:
            raise FetchError(f"body is above the {cap}-byte limit", FetchReason.TOO_LARGE)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise FetchError("malformed chunk terminator", FetchReason.PROTOCOL)
