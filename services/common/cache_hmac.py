"""Signed embedding cache entries: an HMAC-SHA256 tag, with a cluster key, over the Redis key and the value.

Whoever can write to Redis could otherwise poison cached embeddings. With a key
(`EPD_CACHE_HMAC_KEY_FILE`, the same file on every service), a stored value is `MAGIC + tag + value`.
Invariants: the tag binds the value to its Redis key (an entry copied under another key fails);
tags are compared in constant time; a missing, short or wrong tag opens as None (the caller's miss),
never an exception.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

MAGIC = b"EPDS1\n"
TAG_BYTES = 32
MIN_KEY_BYTES = 32


class CacheSigner:
    """Signs and opens cache values with one cluster key (see the module invariants)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the cache HMAC key must have at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    @classmethod
    def from_file(cls, path: str) -> CacheSigner | None:
        """The signer for a key file (surrounding whitespace ignored); None when `path` is empty (unsigned)."""
        if not path:
            return None
        return cls(Path(path).read_bytes().strip())

    def _tag(self, redis_key: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        encoded = redis_key.encode()
        mac.update(len(encoded).to_bytes(4, "big") + encoded)
        mac.update(value)
        return mac.digest()

    def sign(self, redis_key: str, value: bytes) -> bytes:
        """What to store under `redis_key`."""
        return MAGIC + self._tag(redis_key, value) + value

    def open(self, redis_key: str, stored: bytes) -> bytes | None:
        """The value when `stored` carries a good tag for `redis_key`, else None."""
        start = len(MAGIC) + TAG_BYTES
        if len(stored) < start or not stored.startswith(MAGIC):
            return None
        value = stored[start:]
        if not hmac.compare_digest(stored[len(MAGIC) : start], self._tag(redis_key, value)):
            return None
        return value
