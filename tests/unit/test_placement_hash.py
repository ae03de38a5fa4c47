"""Rendezvous hashing of items onto encoders (services/common/placement_hash.py)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from services.common.placement_hash import encoder_for, group_by_encoder

ENCODERS = [f"10.0.0.{i}:50061" for i in range(1, 5)]
HASHES = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(2000)]


def test_deterministic_and_independent_of_order_and_duplicates() -> None:
    for mm_hash in HASHES[:200]:
        owner = encoder_for(mm_hash, ENCODERS)
        assert owner in ENCODERS
        assert encoder_for(mm_hash, list(reversed(ENCODERS))) == owner
        assert encoder_for(mm_hash, [*ENCODERS, ENCODERS[0]]) == owner


def test_spread_is_roughly_even() -> None:
    counts = Counter(encoder_for(h, ENCODERS) for h in HASHES)
    assert set(counts) == set(ENCODERS)
    assert min(counts.values()) > 0.8 * len(HASHES) / len(ENCODERS)


def test_membership_changes_move_only_what_they_must() -> None:
    before = {h: encoder_for(h, ENCODERS) for h in HASHES}
    removed = ENCODERS[1]
    after = {h: encoder_for(h, [e for e in ENCODERS if e != removed]) for h in HASHES}
    assert all(after[h] == before[h] for h in HASHES if before[h] != removed)
    grown = {h: encoder_for(h, [*ENCODERS, "10.0.0.9:50061"]) for h in HASHES}
    moved = [h for h in HASHES if grown[h] != before[h]]
    assert all(grown[h] == "10.0.0.9:50061" for h in moved)
    assert 0.1 < len(moved) / len(HASHES) < 0.3


def test_group_by_encoder_and_empty_list() -> None:
    groups = group_by_encoder(HASHES[:50], ENCODERS)
    assert sorted(i for indexes in groups.values() for i in indexes) == list(range(50))
    for encoder, indexes in groups.items():
        assert all(encoder_for(HASHES[i], ENCODERS) == encoder for i in indexes)
    with pytest.raises(ValueError, match="no encoders"):
        encoder_for(HASHES[0], [])
