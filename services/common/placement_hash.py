"""Which encoder encodes an item: rendezvous (highest-random-weight) hashing of its `mm_hash`.

Every router computes the same answer from the same encoder list, with no shared state, so all
requests for one image meet on one encoder and its in-flight dedupe (the cluster-wide Redis lock
in services/encoder/inflight_lock.py remains the safety net while membership changes).

Invariants: the result depends only on `mm_hash` and the *set* of addresses (order and
duplicates do not matter); removing an encoder moves only the items it owned; adding one takes
about 1/N of the items from the others. Scores are sha256, never Python's `hash()`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _score(address: str, mm_hash: str) -> bytes:
    return hashlib.sha256(f"{len(address)}:{address}|{mm_hash}".encode()).digest()


def encoder_for(mm_hash: str, encoders: list[str]) -> str:
    """The encoder address in `encoders` that owns `mm_hash`. Raises ValueError when the list is empty."""
    if not encoders:
        raise ValueError("no encoders to place the item on")
    return max(set(encoders), key=lambda address: (_score(address, mm_hash), address))


def group_by_encoder(mm_hashes: Iterable[str], encoders: list[str]) -> dict[str, list[int]]:
    """Item indexes per owning encoder, for splitting one request's items into per-encoder calls."""
    groups: dict[str, list[int]] = {}
    for index, mm_hash in enumerate(mm_hashes):
        groups.setdefault(encoder_for(mm_hash, encoders), []).append(index)
    return groups
