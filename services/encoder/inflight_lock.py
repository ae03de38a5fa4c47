"""Cluster-wide once-only encoding: a Redis lock per `mm_hash` while one encoder encodes it.

Key `epd:encl:<model revision>:<mm_hash>`, value the owner's token, set with NX and a TTL. An
encoder that misses the cache takes the lock before it decodes; one that finds the lock taken
waits for the owner's embedding to appear in the shared cache instead of encoding it again.

Invariants:
- Only the owner deletes its lock (compare-and-delete script); an owner that dies loses the lock
  at the TTL, after which a waiter takes it and encodes.
- A live owner's locks outlast the TTL: a thread renews every lock it holds every third of the TTL
  (compare-and-expire), so the TTL bounds how long waiters wait for a dead owner (5 s by default), not
  how long an encode may take (a video's frames took 15.7 s on a loaded host).
- Redis errors never fail a request: `acquire` then answers True (fail open: the cost is a
  duplicate encode) and `peer_state` answers "neither cached nor locked" (the caller encodes).
  After an error Redis is skipped for `retry_after_s`, so an outage costs one timeout, not one
  per item.
- The lock only dedupes across encoders; within one encoder the pipeline's in-flight table does.
"""

from __future__ import annotations

import logging
import threading
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

_RENEW = """
local renewed = 0
for _, key in ipairs(KEYS) do
  if redis.call('get', key) == ARGV[1] then redis.call('pexpire', key, ARGV[2]); renewed = renewed + 1 end
end
return renewed
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
        ttl_s: float = 5.0,
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
        self._renew = self._redis.register_script(_RENEW)
        self._retry_after_s = retry_after_s
        self._down_until = 0.0
        self._held: set[str] = set()  # the keys this encoder took and has not released
        self._held_lock = threading.Lock()  # acquire and release run on any I/O thread
        self._closed = threading.Event()
        self._renewer = threading.Thread(target=self._renew_held, name="inflight-lock-renew", daemon=True)
        self._renewer.start()

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
        key = self.key(mm_hash)
        try:
            taken = bool(self._redis.set(key, self._token, nx=True, px=self._ttl_ms))
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return True
        if taken:
            with self._held_lock:
                self._held.add(key)
        return taken

    def release(self, mm_hash: str) -> None:
        """Drop the lock if this encoder still owns it (else it expires by its TTL)."""
        with self._held_lock:
            self._held.discard(self.key(mm_hash))
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

    def renew(self) -> int:
        """Extend every lock this encoder still owns to a full TTL; how many it extended (0 when Redis is down)."""
        with self._held_lock:
            keys = sorted(self._held)
        if not keys or not self._available():
            return 0
        try:
            return int(self._renew(keys=keys, args=[self._token, self._ttl_ms]))
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return 0

    def _renew_held(self) -> None:
        while not self._closed.wait(self._ttl_ms / 3000):
            self.renew()

    def close(self) -> None:
        """Stop renewing (the locks still held then expire by their TTL, as a dead owner's) and disconnect."""
        self._closed.set()
        if self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        self._redis.close()
