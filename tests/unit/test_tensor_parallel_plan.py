"""The tensor-parallel shard plan: which heads, columns and vocabulary rows each rank holds, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.worker.engine.config import EngineConfig
from services.worker.engine.tensor_parallel.plan import ShardPlan, split


def test_even_split() -> None:
    plan = ShardPlan.of_sizes(heads=28, kv=4, head_dim=128, vocab=152064, size=4)  # Qwen2-VL-7B's heads
    assert [len(q) for q in plan.q_heads] == [7, 7, 7, 7] and [len(k) for k in plan.kv_heads] == [1, 1, 1, 1]
    assert plan.groups == (7, 7, 7, 7) and not plan.replicated
    assert [len(v) for v in plan.vocab] == [38016] * 4


def test_uneven_heads_and_vocabulary_split_with_rank_0_the_largest() -> None:
    plan = ShardPlan.of_sizes(heads=6, kv=3, head_dim=16, vocab=563, size=2)
    assert plan.kv_heads == (range(0, 2), range(2, 3)) and plan.q_heads == (range(0, 4), range(4, 6))
    assert plan.groups == (2, 2) and plan.max_kv_heads == 2
    assert plan.vocab == (range(0, 282), range(282, 563))


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    plan = ShardPlan.of_sizes(heads=8, kv=2, head_dim=64, vocab=100, size=4)
    assert plan.replicated
    assert plan.kv_heads == (range(0, 1), range(0, 1), range(1, 2), range(1, 2))
    assert plan.q_heads == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert plan.groups == (2, 2, 2, 2)


@pytest.mark.parametrize(
    ("heads", "kv", "size", "words"),
    [
        (4, 2, 3, "multiple of 2"),  # 3 ranks over 2 KV heads
        (3, 1, 2, "evenly"),  # one KV head's 3 query heads over 2 replicas
        (2, 2, 4, "exceeds"),  # more ranks than query heads
        (4, 2, 9, "within 1..8"),
    ],
)
def test_refusals_name_what_does_not_divide(heads: int, kv: int, size: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ShardPlan.of_sizes(heads=heads, kv=kv, head_dim=16, vocab=100, size=size)


def test_engine_config_checks_the_size() -> None:
    with pytest.raises(ValueError, match="EngineConfig.tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s"):
        EngineConfig(tensor_parallel_timeout_s=0)


@given(st.integers(1, 64), st.integers(1, 8))
def test_split_covers_everything_once_in_order(total: int, parts: int) -> None:
    ranges = split(total, parts)
    assert [i for r in ranges for i in r] == list(range(total))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1 and len(ranges[0]) == max(map(len, ranges))


@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 8), st.integers(1, 8))
def test_every_query_head_reads_a_kv_head_of_its_own_rank(kv: int, group: int, size: int) -> None:
    heads = kv * group
    try:
        plan = ShardPlan.of_sizes(heads=heads, kv=kv, head_dim=16, vocab=1000, size=size)
    except ValueError:
        return
    assert sorted(h for q in plan.q_heads for h in q) == list(range(heads))  # each query head on one rank
    for q, k in zip(plan.q_heads, plan.kv_heads, strict=True):
        assert {h // group for h in q} == set(k)  # the KV heads its query heads read, and only those
        assert len(q) % len(k) == 0


def test_the_engine_process_cannot_spawn_ranks(tiny_model_dir: Path) -> None:
    from services.common.config import ConfigError, load
    from services.worker.config import WorkerConfig

    env = {"EPD_MODEL": str(tiny_model_dir), "EPD_ENGINE_PROCESS": "true", "EPD_TENSOR_PARALLEL_SIZE": "2"}
    with pytest.raises(ConfigError, match="EPD_ENGINE_PROCESS=on cannot spawn tensor-parallel ranks"):
        load(WorkerConfig, env=env)


def test_channel_files_of_dead_creators_are_removed(tmp_path: Path) -> None:
    """A worker killed while its ranks started leaves its /dev/shm file; the next one to start removes it."""
    import os
    import subprocess

    from services.worker.engine.tensor_parallel.channel import PREFIX, remove_orphans

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live, other = (tmp_path / f"{PREFIX}{gone.pid}-abc", tmp_path / f"{PREFIX}{os.getpid()}-def", tmp_path / "x")
    for path in (dead, live, other):
        path.write_bytes(b"")
    remove_orphans(str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()
