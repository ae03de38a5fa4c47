"""Signed embedding cache entries (services/common/cache_hmac.py) in the cache, against a real Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.cache_hmac import MAGIC, CacheSigner
from services.common.embedding_cache import CacheSettings, EmbeddingCache, pack
from tests.redis_server import RedisServer

KEY = b"k" * 32


def test_sign_and_open_bind_the_value_to_its_key() -> None:
    signer = CacheSigner(KEY)
    stored = signer.sign("epd:emb:r:a", b"value")
    assert signer.open("epd:emb:r:a", stored) == b"value"
    assert signer.open("epd:emb:r:b", stored) is None, "an entry copied under another key must fail"
    assert CacheSigner(b"o" * 32).open("epd:emb:r:a", stored) is None, "another cluster key must fail"
    tampered = stored[:-1] + bytes([stored[-1] ^ 1])
    assert signer.open("epd:emb:r:a", tampered) is None
    assert signer.open("epd:emb:r:a", b"value") is None  # unsigned
    assert signer.open("epd:emb:r:a", MAGIC + b"short") is None
    with pytest.raises(ValueError, match="at least 32 bytes"):
        CacheSigner(b"short")


def test_key_file_is_read_without_surrounding_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    signer = CacheSigner.from_file(str(path))
    assert signer is not None and signer.open("k", CacheSigner(KEY).sign("k", b"v")) == b"v"
    assert CacheSigner.from_file("") is None


def test_a_tampered_entry_is_a_miss_in_get_and_contains(redis_server: RedisServer) -> None:
    events: list[tuple[str, str]] = []
    settings = CacheSettings(redis_server.url, "rev", signer=CacheSigner(KEY))
    cache = EmbeddingCache(settings, on_event=lambda kind, tier: events.append((kind, tier)))
    reader = EmbeddingCache(settings)
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cache.put("h1", tensor)
    assert reader.contains(["h1"]) == [True]
    assert torch.equal(reader.get("h1").tensor, tensor)
    client = redis_server.client()
    stored = client.get(cache.key("h1"))
    assert stored.startswith(MAGIC)
    client.set(cache.key("h1"), stored[:-4] + b"\x00\x00\x80\x7f")  # one float changed
    reader.forget_memory()
    assert reader.contains(["h1"]) == [False]
    assert reader.get("h1").tier == "miss"
    client.set(cache.key("h2"), pack(tensor))  # a writer without the key: unsigned
    assert reader.contains(["h2"]) == [False]
    assert not reader.get("h2").hit
    cache.forget_memory()
    assert not cache.get("h1").hit
    assert ("error", "bad_tag") in events
    cache.put("h1", tensor)  # encoded again: a good entry replaces the bad one
    reader.forget_memory()
    assert torch.equal(reader.get("h1").tensor, tensor)
    for each in (cache, reader):
        each.close()
