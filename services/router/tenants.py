"""Tenancy at the router: what the tenant is folded into, and per-tenant limits (`EPD_TENANT_LIMITS_FILE`).

A tenant's prefix-cache blocks and (by default) its embedding cache entries are its own: the router
folds the tenant id into the prefix salt and into every media item's key server-side, so nothing a
client sends can reach another tenant's cache (`cache_salt` only splits further inside the tenant).

Limits file: one line per tenant, `<tenant id> concurrency=<n> tokens_per_minute=<n>` (either may be
left out or 0: unlimited); the tenant `*` applies to every tenant without a line of its own; `#` starts
a comment. Invariants of `TenantGate`: a tenant never has more than `concurrency` requests between
`enter` and `leave`; projected tokens charged in any window of 60 s never exceed `tokens_per_minute`
plus what had been left unspent (a token bucket of that size, refilled continuously); a refusal is a
Rejection (RESOURCE_EXHAUSTED with `retry-after-ms`) and takes nothing. The file is re-read when it
changes; one that cannot be read or parsed keeps the previous limits (logged).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from services.common.rpc.epd.v1 import common_pb2
from services.common.watched_files import WatchedFiles
from services.router.admission import Rejection
from services.router.auth import TENANT_ID, Authenticator
from services.router.config import RouterConfig

log = logging.getLogger(__name__)
ANY = "*"


def prefix_salt(tenant: str, client_salt: str) -> str:
    """The salt of a request's block 0: its tenant, then the client's `cache_salt` within that tenant."""
    return f"tenant:{len(tenant)}:{tenant}:{client_salt}"


def item_key(mm_hash: str, tenant: str, shared: bool) -> str:
    """The key a media item goes by downstream (encoder, cache, worker, block hashes): its `mm_hash` when
    embeddings are shared across tenants, else a hash of (tenant, mm_hash) of the same form."""
    if shared:
        return mm_hash
    return hashlib.sha256(b"epd-tenant-item-v1\0" + tenant.encode() + b"\0" + mm_hash.encode()).hexdigest()


def scope_items(refs: Iterable[common_pb2.MediaRef], tenant: str, shared: bool) -> None:
    """Re-key a request's media refs for `tenant` in place (before anything downstream sees them)."""
    for ref in refs:
        ref.mm_hash = item_key(ref.mm_hash, tenant, shared)


@dataclass(frozen=True)
class TenantLimit:
    """One tenant's limits; 0 means unlimited."""

    concurrency: int = 0
    tokens_per_minute: int = 0


def parse_limits(text: str) -> dict[str, TenantLimit]:
    """Tenant id (or `*`) -> its limits; ValueError naming the line on anything malformed."""
    limits: dict[str, TenantLimit] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        tenant, values = fields[0], {}
        if tenant != ANY and not TENANT_ID.match(tenant):
            raise ValueError(f"line {number}: {tenant!r} is not a tenant id")
        for field in fields[1:]:
            name, _, value = field.partition("=")
            if name not in ("concurrency", "tokens_per_minute") or not value.isdigit():
                raise ValueError(f"line {number}: expected concurrency=<n> and/or tokens_per_minute=<n>, got {field!r}")
            values[name] = int(value)
        limits[tenant] = TenantLimit(**values)
    return limits


class LimitsFile:
    """The limits file, re-read when it changes (see the module invariants)."""

    def __init__(self, path: str) -> None:
        self._file = WatchedFiles(
            [path], lambda contents: parse_limits(contents[0].decode("utf-8")), "EPD_TENANT_LIMITS_FILE"
        )

    def limit(self, tenant: str) -> TenantLimit:
        limits = self._file.current()
        return limits.get(tenant) or limits.get(ANY) or TenantLimit()


@dataclass
class _Bucket:
    level: float
    at: float


class TenantGate:
    """Per-tenant concurrency and projected tokens per minute (invariants in the module docstring)."""

    def __init__(
        self, limits: LimitsFile | None, retry_after_ms: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limits = limits
        self._retry_after_ms = retry_after_ms
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def _limit(self, tenant: str) -> TenantLimit:
        return self._limits.limit(tenant) if self._limits is not None else TenantLimit()

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def enter(self, tenant: str) -> None:
        """Count one more request of `tenant`, or raise Rejection when it is at its concurrency limit."""
        limit = self._limit(tenant).concurrency
        if limit and self.in_flight(tenant) >= limit:
            raise Rejection(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"tenant {tenant!r} has {limit} requests in flight, its limit; retry later",
                "tenant_concurrency",
                self._retry_after_ms,
            )
        self._in_flight[tenant] = self.in_flight(tenant) + 1

    def leave(self, tenant: str) -> None:
        """The pair of a successful `enter`."""
        left = self.in_flight(tenant) - 1
        if left > 0:
            self._in_flight[tenant] = left
        else:
            self._in_flight.pop(tenant, None)

    def charge(self, tenant: str, tokens: int) -> None:
        """Take `tokens` projected tokens from the tenant's minute, or raise Rejection with the wait."""
        per_minute = self._limit(tenant).tokens_per_minute
        if not per_minute:
            return
        now = self._clock()
        bucket = self._buckets.setdefault(tenant, _Bucket(float(per_minute), now))
        rate = per_minute / 60.0
        bucket.level = min(float(per_minute), bucket.level + (now - bucket.at) * rate)
        bucket.at = now
        if tokens <= bucket.level:
            bucket.level -= tokens
            return
        if tokens > per_minute:
            message = f"request projects {tokens} tokens, over tenant {tenant!r}'s {per_minute} per minute"
            wait_ms = 60_000
        else:
            message = f"tenant {tenant!r} is over its {per_minute} projected tokens per minute; retry later"
            wait_ms = math.ceil((tokens - bucket.level) / rate * 1000)
        raise Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "tenant_tokens", wait_ms)


@dataclass(frozen=True)
class Tenancy:
    """What the router knows about tenants: who calls (`auth`), their limits (`gate`), and whether
    embeddings are shared across tenants (prefix blocks never are)."""

    auth: Authenticator
    gate: TenantGate
    share_embeddings: bool = False

    @classmethod
    def from_config(cls, config: RouterConfig) -> Tenancy:
        limits = LimitsFile(config.tenant_limits_file) if config.tenant_limits_file else None
        return cls(
            Authenticator.from_file(config.api_keys_file),
            TenantGate(limits, config.retry_after_ms),
            config.share_embeddings_across_tenants,
        )
