"""Cluster-wide once-only encoding: a Redis lock per `mm_hash` while one encoder encodes it.

Key `epd:encl:<model revision>:<mm_hash>`, value the owner's token, set with NX and a TTL. An
encoder that misses the cache takes the lock before it decodes; one that finds the lock taken
waits for the owner's embedding to appear in the shared cache instead of encoding it again.

Invariants:
- Only the owner deletes its lock (compare-and-delete script); an owner that dies loses the lock
  at the TTL, after which a waiter takes it and encodes.
- Redis errors never fail a request: `acquire` then answers True (fail open: the cost is a
  duplicate encode) and `peer_state` answers "neither cached nor locked" (the caller encodes).
  After an error Redis is skipped for `retry_after_s`, so an outage costs one timeout, not one
  per item.
- The lock only dedupes across encoders; within one encoder the pipeline's in-flight table does.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

log = logging.getLogger(__name__)

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class PeerState:
    """What Redis says about an item another encoder holds the lock for."""

    cached: bool
    locked: bool


class InflightLocks:
    """Acquire / release / inspect the per-item encode locks (blocking calls: run them off the loop)."""

    def __init__(
        self,
        redis_url: str,
        revision: str,
        cache_key: Callable[[str], str],
        ttl_s: float = 30.0,
        socket_timeout_s: float = 0.25,
        retry_after_s: float = 1.0,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self._revision = revision
        self._cache_key = cache_key
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._token = uuid.uuid4().hex
        self._on_error = on_error or (lambda: None)
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        self._release = self._redis.register_script(_RELEASE)
        self._retry_after_s = retry_after_s
        self._down_until = 0.0

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        log.warning("in-flight lock: Redis unavailable (%s); encoding without the cluster-wide lock", exc)
        self._down_until = time.monotonic() + self._retry_after_s
        self._on_error()

    def key(self, mm_hash: str) -> str:
        return f"epd:encl:{self._revision}:{mm_hash}"

    def acquire(self, mm_hash: str) -> bool:
        """True when this encoder now owns the item (or Redis cannot say: fail open)."""
        if not self._available():
            return True
        try:
            return bool(self._redis.set(self.key(mm_hash), self._token, nx=True, px=self._ttl_ms))
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return True

    def release(self, mm_hash: str) -> None:
        """Drop the lock if this encoder still owns it (else it expires by its TTL)."""
        if not self._available():
            return
        try:
            self._release(keys=[self.key(mm_hash)], args=[self._token])
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)

    def peer_state(self, mm_hash: str) -> PeerState:
        """Whether the embedding is cached yet and whether its lock is still held."""
        if not self._available():
            return PeerState(cached=False, locked=False)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.exists(self._cache_key(mm_hash))
            pipe.exists(self.key(mm_hash))
            cached, locked = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return PeerState(cached=False, locked=False)
        return PeerState(cached=bool(cached), locked=bool(locked))

    def close(self) -> None:
        self._redis.close()
