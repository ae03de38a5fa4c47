"""Full collections off the request path: none automatic after start, one from the thread when quiet or overdue."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from services.common.collector import FullCollections


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle_in_oldest_generation() -> weakref.ref:
    """A two-object cycle promoted to the oldest generation while referenced, then dropped: garbage only a full
    collection finds."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.collect(1)  # survivors of a middle collection move to the oldest generation
    assert gc.is_tracked(a)
    return weakref.ref(a)


@pytest.mark.parametrize(
    ("since_last_s", "busy_share", "due"),
    [
        (5.0, 0.0, False),  # quiet, but collected too recently
        (10.0, 0.05, True),  # quiet and long enough ago
        (30.0, 0.5, False),  # busy
        (120.0, 1.0, True),  # busy, but overdue
    ],
)
def test_due(since_last_s: float, busy_share: float, due: bool) -> None:
    assert FullCollections(min_interval_s=10, max_interval_s=120).due(since_last_s, busy_share) is due


def test_bad_intervals_refused() -> None:
    with pytest.raises(ValueError, match="min_interval_s"):
        FullCollections(min_interval_s=10, max_interval_s=5)


def test_no_automatic_full_collection_and_thresholds_restored() -> None:
    before = gc.get_threshold()
    collections = FullCollections(check_s=0.05, min_interval_s=100, max_interval_s=100)
    collections.start()
    try:
        assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 10**6
        full_before = gc.get_stats()[2]["collections"]
        dead = _cycle_in_oldest_generation()
        for _ in range(200_000):  # thousands of young collections' worth of tracked objects
            Node()
            [Node()]
        assert gc.get_stats()[2]["collections"] == full_before
        assert dead() is not None  # nothing but a full collection would free it
    finally:
        collections.stop()
    assert gc.get_threshold() == before
    gc.collect()


@pytest.mark.parametrize(
    ("max_interval_s", "meanwhile"),
    [
        (100.0, lambda: time.sleep(0.05)),  # quiet: the thread collects once the minimum interval passed
        (0.5, lambda: sum(range(10_000))),  # a core's worth of work, never quiet: collected when overdue
    ],
    ids=["quiet", "busy"],
)
def test_the_thread_collects_the_oldest_garbage(max_interval_s: float, meanwhile) -> None:
    collections = FullCollections(check_s=0.05, min_interval_s=0.1, max_interval_s=max_interval_s)
    collections.start()
    try:
        dead = _cycle_in_oldest_generation()
        deadline = time.monotonic() + 10
        while dead() is not None and time.monotonic() < deadline:
            meanwhile()
        assert dead() is None
        assert collections.collections >= 1
    finally:
        collections.stop()
