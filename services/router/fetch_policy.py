"""What the router's media fetcher may reach: the policy, the URL parser and the address classifier.

Invariants:
- A URL is parsed once, strictly; whatever the checks here accept is exactly what the fetcher
  connects to (the same host string, the same port), so no later parser can disagree with them.
- A numeric host is accepted only as a canonical dotted quad or a bracketed IPv6 literal; every other
  numeric spelling that `inet_aton` would take (decimal, octal, hex, short forms) is refused outright.
- An address is allowed only when it is globally routable unicast: `classify_address` refuses by
  category, and IPv6 forms that embed an IPv4 address are judged by the address they embed.
- `allow_loopback_for_tests` adds exactly 127.0.0.1 and ::1 and nothing else; it is never a default.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import ssl
from dataclasses import dataclass, field
from enum import StrEnum

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

TEST_LOOPBACK = frozenset({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")})
DEFAULT_PORTS = {"https": 443, "http": 80}
MAX_URL_CHARS = 8192

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")
_V4_NOT_GLOBAL = (  # special-purpose blocks that some Python versions still call global
    ("IETF protocol assignments", ipaddress.ip_network("192.0.0.0/24")),
    ("shared address space", ipaddress.ip_network("100.64.0.0/10")),
    ("this network", ipaddress.ip_network("0.0.0.0/8")),
)
_V6_COMPAT = ipaddress.ip_network("::/96")
_V6_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V6_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


class FetchReason(StrEnum):
    """Short machine reason for a refused fetch, used as a metric label."""

    URL = "url"
    SCHEME = "scheme"
    HOST_NOT_ALLOWED = "host_not_allowed"
    ADDRESS = "address"
    DNS = "dns"
    CONNECT = "connect"
    TLS = "tls"
    TIMEOUT = "timeout"
    REDIRECT = "redirect"
    HTTP_STATUS = "http_status"
    PROTOCOL = "protocol"
    TOO_LARGE = "too_large"


class FetchError(ValueError):
    """A URL the router will not or could not fetch; the client gets INVALID_ARGUMENT with the message."""

    def __init__(self, message: str, reason: FetchReason | str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = FetchReason(reason)

    def __reduce__(self) -> tuple[type[FetchError], tuple[str, str]]:
        return (FetchError, (self.message, str(self.reason)))


@dataclass(frozen=True)
class FetchPolicy:
    """Limits for one fetch. Defaults are the production setting: https only, no redirects.

    `allowed_hosts` entries are an exact host ("img.example.com") or "*.suffix" (any name strictly
    below the suffix, not the suffix itself). `allow_loopback_for_tests` lets tests reach a server on
    127.0.0.1 or ::1 only (never any private range), with plain http only towards those two addresses.
    Build one policy at startup and reuse it: it memoises its TLS context.
    """

    allowed_schemes: tuple[str, ...] = ("https",)
    allowed_hosts: frozenset[str] | None = None
    max_bytes: int = 20 << 20
    connect_timeout_s: float = 5.0
    total_timeout_s: float = 30.0
    max_redirects: int = 0
    allow_loopback_for_tests: bool = False
    _tls: dict[str, ssl.SSLContext] = field(default_factory=dict, init=False, repr=False, compare=False)

    async def tls_context(self) -> ssl.SSLContext:
        """The verifying client context (system trust store), built once per policy off the event loop."""
        if "default" not in self._tls:  # loading the trust store takes tens of ms: never on the loop
            self._tls["default"] = await asyncio.to_thread(ssl.create_default_context)
        return self._tls["default"]

    def __post_init__(self) -> None:
        if not self.allowed_schemes or not set(self.allowed_schemes) <= DEFAULT_PORTS.keys():
            raise ValueError(f"FetchPolicy.allowed_schemes must be a non-empty subset of {sorted(DEFAULT_PORTS)}")
        for name in ("max_bytes", "connect_timeout_s", "total_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FetchPolicy.{name} must be positive, got {getattr(self, name)!r}")
        if self.max_redirects < 0:
            raise ValueError(f"FetchPolicy.max_redirects must be >= 0, got {self.max_redirects}")
        for pattern in self.allowed_hosts or ():
            if pattern != pattern.lower() or not pattern.removeprefix("*.") or "*" in pattern.removeprefix("*."):
                raise ValueError(f"FetchPolicy.allowed_hosts: {pattern!r} is not a lower-case host or '*.suffix'")


@dataclass(frozen=True)
class AddressVerdict:
    """Whether the fetcher may connect to an address; `category` names the class ("global unicast" if allowed)."""

    address: IPAddress
    allowed: bool
    category: str


@dataclass(frozen=True)
class Target:
    """A strictly parsed URL: `host` is lower case, without brackets; `literal` is set when it is an IP."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    literal: IPAddress | None

    @property
    def host_header(self) -> str:
        name = f"[{self.host}]" if isinstance(self.literal, ipaddress.IPv6Address) else self.host
        return name if self.port == DEFAULT_PORTS[self.scheme] else f"{name}:{self.port}"


def _first(checks: tuple[tuple[bool, str], ...]) -> str | None:
    return next((category for hit, category in checks if hit), None)


def _v4_category(ip: ipaddress.IPv4Address) -> str | None:
    return _first(
        (
            (ip.is_unspecified, "unspecified"),
            (ip.is_loopback, "loopback"),
            (ip.is_link_local, "link-local (cloud metadata lives here)"),
            (ip.is_multicast, "multicast"),
            (ip == ipaddress.IPv4Address("255.255.255.255"), "broadcast"),
            *((ip in net, category) for category, net in _V4_NOT_GLOBAL),
            (ip.is_private, "private"),
            (ip.is_reserved, "reserved"),
            (not ip.is_global, "special-purpose"),
        )
    )


def _v6_category(ip: ipaddress.IPv6Address) -> str | None:
    category = _first(
        (
            (ip.is_unspecified, "unspecified"),
            (ip.is_loopback, "loopback"),
            (ip.ipv4_mapped is not None, "IPv4-mapped IPv6"),
            (ip in _V6_COMPAT, "IPv4-compatible IPv6"),
            (ip.teredo is not None, "Teredo"),
            (ip in _V6_NAT64_LOCAL, "local-use NAT64"),
            (ip.is_link_local, "link-local"),
            (ip.is_site_local, "site-local"),
            (ip.is_multicast, "multicast"),
        )
    )
    nat64 = ip in _V6_NAT64
    embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if nat64 else ip.sixtofour
    if category is not None or embedded is None:
        return category or _first(
            ((ip.is_private, "private"), (ip.is_reserved, "reserved"), (not ip.is_global, "special-purpose"))
        )
    inner = _v4_category(embedded)
    if inner is not None:
        return f"{'NAT64' if nat64 else '6to4'} embedding a {inner} IPv4 address"
    # A public IPv4 behind the well-known NAT64 prefix is how IPv6-only clusters reach the internet;
    # 6to4 of a public IPv4 is itself global unicast.
    return None


def classify_address(ip: IPAddress) -> AddressVerdict:
    """Judge one address under the production rules (no test allowance)."""
    category = _v4_category(ip) if isinstance(ip, ipaddress.IPv4Address) else _v6_category(ip)
    return AddressVerdict(ip, category is None, category or "global unicast")


def host_allowed(host: str, allowed_hosts: frozenset[str] | None) -> bool:
    """True when there is no allowlist, or `host` equals an entry or lies strictly below a '*.suffix' entry."""
    if allowed_hosts is None:
        return True
    return any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in allowed_hosts)


def _parse_host(raw: str) -> tuple[str, IPAddress | None]:
    if raw.startswith("["):
        try:
            ip = ipaddress.IPv6Address(raw[1:-1]) if raw.endswith("]") and "%" not in raw else None
        except ValueError:
            ip = None
        if ip is None:
            raise FetchError(f"malformed IPv6 literal {raw!r} (zone ids are not accepted)", FetchReason.URL)
        return str(ip), ip
    host = raw.lower().removesuffix(".")
    labels = host.split(".")
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise FetchError(f"malformed host name {raw!r} (use ASCII/punycode labels)", FetchReason.URL)
    if _NUMERIC_LABEL.match(labels[-1]):
        try:
            return host, ipaddress.IPv4Address(host)
        except ValueError:
            raise FetchError(
                f"numeric host {raw!r} is not a canonical dotted-quad IPv4 address; decimal, "
                "octal, hex and short forms are refused",
                FetchReason.ADDRESS,
            ) from None
    return host, None


def parse_target(url: str, policy: FetchPolicy) -> Target:
    """Parse and check a URL before any resolution; raises FetchError (url, scheme, address, host_not_allowed)."""
    if len(url) > MAX_URL_CHARS or not url.isascii() or not url.isprintable() or " " in url or "\\" in url:
        raise FetchError(
            f"URL must be printable ASCII without spaces or backslashes, at most {MAX_URL_CHARS} characters",
            FetchReason.URL,
        )
    scheme, sep, rest = url.partition(":")
    scheme = scheme.lower()
    test_http = scheme == "http" and policy.allow_loopback_for_tests
    if not sep or (scheme not in policy.allowed_schemes and not test_http):
        raise FetchError(
            f"URL scheme {scheme!r} is not allowed; use {' or '.join(policy.allowed_schemes)}", FetchReason.SCHEME
        )
    if not rest.startswith("//"):
        raise FetchError("URL has no host", FetchReason.URL)
    raw_host, raw_port, path = _split_authority(rest[2:])
    if not raw_host:
        raise FetchError("URL has no host", FetchReason.URL)
    if raw_port is not None and not (raw_port.isdigit() and len(raw_port) <= 5 and 0 < int(raw_port) < 65536):
        raise FetchError(f"bad port {raw_port!r}", FetchReason.URL)
    host, literal = _parse_host(raw_host)
    if not host_allowed(host, policy.allowed_hosts):
        raise FetchError(f"host {host!r} is not in the fetch allowlist", FetchReason.HOST_NOT_ALLOWED)
    port = int(raw_port) if raw_port else DEFAULT_PORTS[scheme]
    target = Target(url, scheme, host, port, path, literal)
    if literal is not None:
        check_resolved(target, [literal], policy)
    return target


def _split_authority(after_slashes: str) -> tuple[str, str | None, str]:
    """`host[:port]/path?query#fragment` -> (host, port, origin-form request target); the fragment is dropped."""
    body = after_slashes.partition("#")[0]
    cut = min((i for i in (body.find("/"), body.find("?")) if i >= 0), default=len(body))
    netloc, tail = body[:cut], body[cut:]
    if "@" in netloc:
        raise FetchError("URLs with credentials (user@host) are refused", FetchReason.URL)
    end = netloc.find("]") + 1 if netloc.startswith("[") else 0  # a bracketed IPv6 literal keeps its colons
    extra, sep, port = netloc[end:].partition(":")
    if (end and extra) or ":" in port:
        raise FetchError(f"malformed host {netloc!r}", FetchReason.URL)
    return netloc[:end] + extra, port if sep else None, tail if tail.startswith("/") else "/" + tail


def check_resolved(target: Target, addresses: list[IPAddress], policy: FetchPolicy) -> None:
    """Raise FetchError unless EVERY address is allowed; plain http under the test allowance needs 127.0.0.1/::1."""
    for ip in addresses:
        verdict = classify_address(ip)
        if not verdict.allowed and not (policy.allow_loopback_for_tests and ip in TEST_LOOPBACK):
            via = "" if target.host == str(ip) else f" ({target.host} resolves to it)"
            raise FetchError(f"refusing to fetch from {verdict.category} address {ip}{via}", FetchReason.ADDRESS)
    if target.scheme not in policy.allowed_schemes and not all(ip in TEST_LOOPBACK for ip in addresses):
        raise FetchError(
            f"URL scheme {target.scheme!r} is allowed only towards the loopback test server", FetchReason.SCHEME
        )
