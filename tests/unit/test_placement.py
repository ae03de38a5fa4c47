"""Worker placement: the prefill a cached prefix saves against the load a worker carries."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load
from services.router.cluster_view import WorkerView
from services.router.config import RouterConfig
from services.router.placement import PrefixAffinity, rank_workers
from services.router.request_blocks import RequestBlocks

PROMPT = [bytes([i]) * 32 for i in range(14)]  # a 14-block prompt's block hashes


def _worker(address: str, reserved: int, waiting: int = 0, capacity: int = 64) -> WorkerView:
    return WorkerView(
        address,
        total_blocks=capacity,
        capacity_blocks=capacity,
        reserved_blocks=reserved,
        running=1 if reserved else 0,
        waiting=waiting,
        block_size=16,
    )


def _ranked(workers: list[WorkerView], affinity: PrefixAffinity, weight: float = 1.0, need: int = 20) -> list[str]:
    request = RequestBlocks(len(PROMPT) * 16, need * 16, lambda size: PROMPT)  # need: in 16-token blocks
    return [w.address for w in rank_workers(workers, request, affinity, weight)]


def test_a_shared_template_block_does_not_pile_requests_onto_a_busy_worker() -> None:
    affinity = PrefixAffinity()
    affinity.record(PROMPT[:1], "a")  # only the chat template's first block was seen on "a"
    assert _ranked([_worker("a", reserved=23), _worker("b", reserved=0)], affinity) == ["b", "a"]


def test_a_long_cached_prefix_wins_over_a_little_more_load() -> None:
    affinity = PrefixAffinity()
    affinity.record(PROMPT[:12], "a")
    assert _ranked([_worker("a", reserved=8), _worker("b", reserved=0)], affinity) == ["a", "b"]
    # the same prefix is not worth 23 reserved blocks at weight 1, but is at weight 2
    assert _ranked([_worker("a", reserved=23), _worker("b", reserved=0)], affinity) == ["b", "a"]
    assert _ranked([_worker("a", reserved=23), _worker("b", reserved=0)], affinity, weight=2.0) == ["a", "b"]


def test_weight_zero_ranks_by_load_then_queue_and_skips_workers_without_room() -> None:
    affinity = PrefixAffinity()
    affinity.record(PROMPT, "a")
    workers = [
        _worker("a", reserved=10),
        _worker("b", reserved=4, waiting=2),
        _worker("c", reserved=4),
        _worker("full", reserved=50),
    ]
    assert _ranked(workers, affinity, weight=0.0) == ["c", "b", "a"]


def test_a_negative_weight_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="EPD_PREFIX_AFFINITY_WEIGHT"):
        load(RouterConfig, env={"EPD_MODEL": "m", "EPD_PREFIX_AFFINITY_WEIGHT": "-1"})
