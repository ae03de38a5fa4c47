"""The cluster-wide embedding cache: an in-process LRU bounded in bytes over Redis.

Keys are `epd:emb:<model revision>:<mm_hash>`; a value is a small header (magic, JSON with
dtype and shape) followed by the raw tensor bytes. Invariants: the LRU never holds more than
`max_bytes`; items over `max_item_bytes` are never stored in either tier; a Redis error or
timeout is a miss (counted), never an exception to the caller. After a Redis failure the
cache skips Redis for `retry_after_s`, so an outage costs one timeout, not one per request,
and resumes by itself when Redis answers again. With a `signer` (services/common/cache_hmac.py)
every Redis value carries an HMAC tag; a value whose tag does not verify is a miss (counted as
`bad_tag`) in `get` and in `contains`, so a poisoned entry is never used and gets encoded again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import torch

from services.common import tensor_codec
from services.common.cache_hmac import CacheSigner

log = logging.getLogger(__name__)
_MAGIC = b"EPDE1\n"


@dataclass(frozen=True)
class CacheLookup:
    """Result of `EmbeddingCache.get`: the tensor and the tier that had it, or a miss."""

    tensor: torch.Tensor | None
    tier: str  # "memory" | "redis" | "miss"

    @property
    def hit(self) -> bool:
        return self.tensor is not None


@dataclass(frozen=True)
class CacheSettings:
    redis_url: str
    revision: str
    max_bytes: int = 512 << 20
    max_item_bytes: int = 64 << 20
    ttl_s: int = 3600
    socket_timeout_s: float = 0.25
    retry_after_s: float = 1.0
    signer: CacheSigner | None = None  # None: Redis values are not signed

    @classmethod
    def for_service(cls, config: Any, revision: str, **overrides: Any) -> CacheSettings:
        """A service's cache from its `EPD_REDIS_URL`, `EPD_EMBEDDING_CACHE_BYTES`, `EPD_EMBEDDING_CACHE_TTL_S`
        and `EPD_CACHE_HMAC_KEY_FILE`."""
        settings = {
            "max_bytes": config.embedding_cache_bytes,
            "ttl_s": config.embedding_cache_ttl_s,
            "signer": CacheSigner.from_file(getattr(config, "cache_hmac_key_file", "")),
            **overrides,
        }
        return cls(config.redis_url, revision, **settings)


def pack(tensor: torch.Tensor) -> bytes:
    """Serialise an embedding as header + raw bytes (lossless)."""
    encoded = tensor_codec.encode(tensor)
    header = json.dumps({"dtype": encoded.dtype, "shape": list(encoded.shape)}).encode()
    return _MAGIC + len(header).to_bytes(4, "big") + header + encoded.data


def unpack(blob: bytes) -> torch.Tensor:
    """Inverse of `pack`; raises CodecError on anything malformed."""
    if not blob.startswith(_MAGIC):
        raise tensor_codec.CodecError("not an epd embedding blob")
    start = len(_MAGIC)
    size = int.from_bytes(blob[start : start + 4], "big")
    header = json.loads(blob[start + 4 : start + 4 + size])
    return tensor_codec.decode(header["dtype"], tuple(header["shape"]), blob[start + 4 + size :])


class EmbeddingCache:
    """Two-tier embedding cache; thread-safe. `on_event(kind, tier)` feeds metrics."""

    def __init__(self, settings: CacheSettings, on_event: Callable[[str, str], None] | None = None) -> None:
        self._settings = settings
        self._lru: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lru_bytes = 0
        self._lock = threading.Lock()
        self._on_event = on_event or (lambda kind, tier: None)
        self._redis = redis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
        )
        self._redis_down_until = 0.0

    def key(self, mm_hash: str) -> str:
        return f"epd:emb:{self._settings.revision}:{mm_hash}"

    @property
    def memory_bytes(self) -> int:
        return self._lru_bytes

    def get(self, mm_hash: str) -> CacheLookup:
        """Look in memory, then Redis (promoting a Redis hit into memory)."""
        with self._lock:
            tensor = self._lru.get(mm_hash)
            if tensor is not None:
                self._lru.move_to_end(mm_hash)
        if tensor is not None:
            self._on_event("hit", "memory")
            return CacheLookup(tensor, "memory")
        blob = self._opened(mm_hash, self._redis_call(lambda r: r.get(self.key(mm_hash))))
        if blob:
            try:
                tensor = unpack(blob)
            except (tensor_codec.CodecError, ValueError, KeyError):
                log.warning("dropping malformed cache entry %s", mm_hash)
                tensor = None
        if tensor is None:
            self._on_event("miss", "all")
            return CacheLookup(None, "miss")
        self._remember(mm_hash, tensor)
        self._on_event("hit", "redis")
        return CacheLookup(tensor, "redis")

    def contains(self, mm_hashes: list[str]) -> list[bool]:
        """Whether either tier holds each item now: one Redis round trip, no data transferred;
        a Redis error reads as False (a miss)."""
        with self._lock:
            found = [h in self._lru for h in mm_hashes]
        missing = [h for h, hit in zip(mm_hashes, found, strict=True) if not hit]
        if not missing:
            return found

        def exists(r: redis.Redis) -> list[object]:
            pipe = r.pipeline(transaction=False)
            for mm_hash in missing:
                if self._settings.signer is None:
                    pipe.exists(self.key(mm_hash))
                else:  # a signed entry counts only once its tag verifies: that takes the value
                    pipe.get(self.key(mm_hash))
            return pipe.execute()

        answers = self._redis_call(exists) or [0] * len(missing)
        if self._settings.signer is not None:
            answers = [self._opened(h, blob) is not None for h, blob in zip(missing, answers, strict=True)]
        found_in_redis = iter(answers)
        return [hit or bool(next(found_in_redis)) for hit in found]

    def put(self, mm_hash: str, tensor: torch.Tensor) -> bool:
        """Store in both tiers; False when the item is over the per-item cap."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._settings.max_item_bytes:
            self._on_event("skip", "too_large")
            return False
        self._remember(mm_hash, tensor)
        blob = pack(tensor)
        if self._settings.signer is not None:
            blob = self._settings.signer.sign(self.key(mm_hash), blob)
        self._redis_call(lambda r: r.set(self.key(mm_hash), blob, ex=self._settings.ttl_s))
        return True

    def _opened(self, mm_hash: str, blob: object) -> bytes | None:
        """A Redis value with its tag checked and removed (unsigned caches: as it is); None for a bad tag."""
        if not blob or self._settings.signer is None:
            return blob or None  # type: ignore[return-value]
        value = self._settings.signer.open(self.key(mm_hash), bytes(blob))  # type: ignore[arg-type]
        if value is None:
            log.warning("embedding cache entry %s has a bad tag; treating it as a miss", mm_hash[:16])
            self._on_event("error", "bad_tag")
        return value

    def remember(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Keep `tensor` in the in-process tier only (a worker holding a pushed embedding)."""
        self._remember(mm_hash, tensor)

    def forget_memory(self) -> None:
        """Drop the in-process tier (tests use this to force a Redis lookup)."""
        with self._lock:
            self._lru.clear()
            self._lru_bytes = 0

    def _remember(self, mm_hash: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._settings.max_bytes:
            return
        with self._lock:
            old = self._lru.pop(mm_hash, None)
            if old is not None:
                self._lru_bytes -= old.numel() * old.element_size()
            self._lru[mm_hash] = tensor
            self._lru_bytes += nbytes
            while self._lru_bytes > self._settings.max_bytes:
                _, evicted = self._lru.popitem(last=False)
                self._lru_bytes -= evicted.numel() * evicted.element_size()

    def _redis_call(self, fn: Callable[[redis.Redis], object]) -> object:
        if time.monotonic() < self._redis_down_until:
            self._on_event("error", "redis_skipped")
            return None
        try:
            return fn(self._redis)
        except (redis.RedisError, OSError) as exc:
            log.warning("embedding cache: Redis unavailable (%s); treating as a miss", exc)
            self._redis_down_until = time.monotonic() + self._settings.retry_after_s
            self._on_event("error", "redis")
            return None

    def close(self) -> None:
        self._redis.close()
