"""Redis with AUTH and TLS for real: registry, embedding cache and encode locks over `rediss://:password@`.

A private redis-server with `--requirepass` and only a TLS port (certificates made here), reached by the
registry, the embedding cache and the encoders' locks through `rediss://:<password>@...?ssl_ca_certs=...`
URLs. Wrong credentials read as Redis being down (a miss, no exception), and a plaintext client gets nothing
from the TLS port.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from services.common.cache_hmac import CacheSigner
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.registry import Registry
from services.encoder.inflight_lock import InflightLocks
from services.launch.local_redis import redis_answers
from tests.certs import CertAuthority
from tests.secure_redis import PASSWORD, SecureRedis


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    with SecureRedis.running(tmp_path_factory.mktemp("redis-tls")) as server:
        yield server


def test_registry_over_tls_with_a_password(secure_redis: SecureRedis) -> None:
    registry = Registry(secure_redis.url(), ttl_s=5.0)
    assert registry.publish("worker", "127.0.0.1:1", "rev", {"free_blocks": 3})
    members = registry.members("worker", "rev")
    assert members is not None and [m.state["free_blocks"] for m in members] == [3]
    wrong = Registry(secure_redis.url("wrong-password"))
    assert not wrong.publish("worker", "127.0.0.1:2", "rev", {})
    assert wrong.members("worker") is None
    for each in (registry, wrong):
        each.close()


def test_embedding_cache_and_locks_over_tls_with_a_password(secure_redis: SecureRedis) -> None:
    settings = CacheSettings(secure_redis.url(), "rev", signer=CacheSigner(b"c" * 32))
    writer, reader = EmbeddingCache(settings), EmbeddingCache(settings)
    tensor = torch.randn(4, 8)
    assert writer.put("item", tensor)
    assert reader.contains(["item"]) == [True]
    assert torch.equal(reader.get("item").tensor, tensor)
    locks = InflightLocks(secure_redis.url(), "rev", writer.key)
    assert locks.acquire("item-2")
    assert not InflightLocks(secure_redis.url(), "rev", writer.key).acquire("item-2")
    assert locks.peer_state("item").cached
    locks.release("item-2")
    wrong = EmbeddingCache(CacheSettings(secure_redis.url("wrong-password"), "rev", signer=CacheSigner(b"c" * 32)))
    assert wrong.get("item").tier == "miss"  # an auth failure is a miss, never an exception
    assert wrong.contains(["item"]) == [False]
    for each in (writer, reader, wrong, locks):
        each.close()


def test_plaintext_and_unverified_clients_get_nothing(secure_redis: SecureRedis, tmp_path: Path) -> None:
    assert not redis_answers(f"redis://:{PASSWORD}@127.0.0.1:{secure_redis.port}/0")
    other = CertAuthority.create(tmp_path, "other")
    assert not redis_answers(f"rediss://:{PASSWORD}@127.0.0.1:{secure_redis.port}/0?ssl_ca_certs={other.cert_file}")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"rediss://127.0.0.1:{secure_redis.port}/0?ssl_ca_certs={secure_redis.ca_file}").ping()
