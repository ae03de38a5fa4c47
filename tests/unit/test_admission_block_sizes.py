"""Admission and placement over workers with different KV block sizes (16 and 256 tokens)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from services.common.block_hash import prompt_block_hashes
from services.common.registry import Member
from services.router.admission import Admission, AdmissionSettings, Rejection, Reserved
from services.router.cluster_view import ClusterView, WorkerView
from services.router.placement import PrefixAffinity, prefill_tokens, rank_workers
from services.router.request_blocks import RequestBlocks
from tests.static_registry import StaticRegistry

PROMPT_IDS = list(range(1000, 1280))  # 280 prompt tokens: 17 blocks of 16, 1 of 256
MAX_TOKENS = 20  # projected 300 tokens: 19 blocks of 16, 2 of 256


def _request(hash_calls: list[int] | None = None) -> RequestBlocks:
    """The 300-token request; `hash_calls` collects the block sizes its prompt gets hashed at."""
    if hash_calls is None:
        return RequestBlocks.for_prompt(PROMPT_IDS, len(PROMPT_IDS) + MAX_TOKENS)

    def hasher(size: int) -> list[bytes]:
        hash_calls.append(size)
        return prompt_block_hashes(PROMPT_IDS, size)

    return RequestBlocks(len(PROMPT_IDS), len(PROMPT_IDS) + MAX_TOKENS, hasher)


def _view(address: str, block_size: int, capacity: int, reserved: int = 0, waiting: int = 0) -> WorkerView:
    return WorkerView(
        address,
        total_blocks=capacity,
        capacity_blocks=capacity,
        reserved_blocks=reserved,
        running=0,
        waiting=waiting,
        block_size=block_size,
    )


class _Registry(StaticRegistry):
    """Registry.members from fixed worker states; their snapshots predate every admission."""

    def __init__(self, workers: list[WorkerView]) -> None:
        self.workers = workers

    def members(self, role: str, revision: str | None = None) -> list[Member]:
        if role != "worker":
            return []
        return [
            Member(
                "worker",
                w.address,
                "r",
                {
                    "total_blocks": w.total_blocks,
                    "capacity_blocks": w.capacity_blocks,
                    "reserved_blocks": w.reserved_blocks,
                    "running": w.running,
                    "waiting": w.waiting,
                    "block_size": w.block_size,
                    "snapshot_at": 0.0,
                },
                0.0,
            )
            for w in self.workers
        ]


async def _admit(
    workers: list[WorkerView],
    request: RequestBlocks,
    affinity: PrefixAffinity | None = None,
    accept: frozenset[str] | None = None,
) -> tuple[Admission, ClusterView, object, list[str]]:
    """Admit `request` on a view of `workers`; those outside `accept` (all when None) refuse."""
    view = ClusterView(_Registry(workers), "r")  # type: ignore[arg-type]
    await view.refresh()
    admission = Admission(view, affinity or PrefixAffinity(), AdmissionSettings(max_wait_s=0.05))
    asked: list[str] = []

    async def try_worker(address: str) -> Reserved[str] | None:
        asked.append(address)
        return Reserved(address, time.time()) if accept is None or address in accept else None

    try:
        admitted = await admission.admit(request, try_worker, time.monotonic() + 1)
    except Rejection as exc:
        return admission, view, exc, asked
    return admission, view, admitted, asked


def test_the_need_is_counted_in_each_workers_own_blocks() -> None:
    request = _request()
    assert (request.need(16), request.need(256)) == (19, 2)
    for size, need in ((16, 19), (256, 2)):
        workers = [_view("w16", 16, 64), _view("w256", 256, 8)]
        accept = frozenset({f"w{size}"})
        admission, view, admitted, _ = asyncio.run(_admit(workers, request, accept=accept))
        assert (admitted.worker, admitted.blocks) == (f"w{size}", need)
        reserved = {w.address: w.reserved_blocks for w in view.workers()}
        assert reserved[f"w{size}"] == need and sum(reserved.values()) == need  # the hold was its own need
        admission.released(admitted.worker, admitted.blocks, 0.0)
        assert all(w.reserved_blocks == 0 for w in view.workers())


def test_a_request_too_big_for_the_256_worker_now_goes_to_the_16_worker() -> None:
    workers = [_view("w256", 256, 8, reserved=7), _view("w16", 16, 64, reserved=44)]  # 1 and 20 blocks free
    _, _, admitted, asked = asyncio.run(_admit(workers, _request()))
    assert asked == ["w16"] and (admitted.worker, admitted.blocks) == ("w16", 19)


def test_never_fits_only_when_no_worker_can_hold_its_own_need() -> None:
    request = _request()
    # 19 blocks of 16 never fit an 18-block worker, but 2 of 256 fit the other: admitted there
    _, _, admitted, _ = asyncio.run(_admit([_view("w16", 16, 18), _view("w256", 256, 2)], request))
    assert (admitted.worker, admitted.blocks) == ("w256", 2)
    _, _, refused, asked = asyncio.run(_admit([_view("w16", 16, 18), _view("w256", 256, 1)], request))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and refused.reason == "never_fits" and not asked
    assert "19 KV blocks of 16 tokens" in refused.message and "2 KV blocks of 256 tokens" in refused.message
    # both could hold it, neither has room now: cluster_full at once
    _, _, full, asked = asyncio.run(
        _admit([_view("w16", 16, 19, reserved=1), _view("w256", 256, 2, reserved=1)], request)
    )
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.reason == "cluster_full" and not asked
    assert "unreserved KV blocks" in full.message


def test_prompt_hashes_are_computed_once_per_size_present_and_only_when_ranking() -> None:
    calls: list[int] = []
    workers = [_view("a", 16, 64), _view("b", 16, 64, reserved=3), _view("c", 16, 64, reserved=5)]
    asyncio.run(_admit(workers, _request(calls), accept=frozenset({"c"})))
    assert calls == [16]  # three workers asked, one hashing
    calls.clear()
    asyncio.run(_admit(workers + [_view("d", 256, 8), _view("e", 256, 8)], _request(calls), accept=frozenset({"e"})))
    assert sorted(calls) == [16, 256]
    calls.clear()
    asyncio.run(_admit([_view("a", 16, 64, reserved=60)], _request(calls)))  # cluster_full: nothing to rank
    assert calls == []


def test_affinity_recorded_at_one_size_matches_only_workers_of_that_size() -> None:
    request, affinity = _request(), PrefixAffinity()
    _, _, admitted, _ = asyncio.run(
        _admit([_view("a", 16, 64), _view("b", 256, 8)], request, affinity, accept=frozenset({"a"}))
    )
    assert admitted.worker == "a"
    assert affinity.matched_blocks(request.hashes(16), "a") == 17
    assert prefill_tokens(request, _view("a", 16, 64), affinity) == 280 - 17 * 16
    # the same address restarted with 256-token blocks: its old 16-token prefix means nothing there
    assert prefill_tokens(request, _view("a", 256, 8), affinity) == 280
    _, _, admitted, _ = asyncio.run(
        _admit([_view("a", 16, 64), _view("b", 256, 8)], request, affinity, accept=frozenset({"b"}))
    )
    assert affinity.matched_blocks(request.hashes(256), "b") == 1
    assert affinity.matched_blocks(request.hashes(16), "b") == 0


def test_costs_compare_in_tokens_across_block_sizes() -> None:
    request, affinity = _request(), PrefixAffinity()
    affinity.record(request.hashes(16), "w16")  # 272 of 280 prompt tokens cached on w16
    # w16 carries 16 x 16 = 256 reserved tokens, w256 carries 1 block = 256: the cached prefix decides
    workers = [_view("w256", 256, 8, reserved=1), _view("w16", 16, 64, reserved=16)]
    assert [w.address for w in rank_workers(workers, request, affinity)] == ["w16", "w256"]
    # 32 blocks of 16 reserved (512 tokens) outweigh 272 cached tokens at weight 1, not at weight 2
    workers = [_view("w256", 256, 8, reserved=0), _view("w16", 16, 64, reserved=32)]
    assert [w.address for w in rank_workers(workers, request, affinity)] == ["w256", "w16"]
    assert [w.address for w in rank_workers(workers, request, affinity, 2.0)] == ["w16", "w256"]


def _old_rank(
    workers: list[WorkerView], need: int, hashes: list[bytes], affinity: PrefixAffinity, weight: float
) -> list[str]:
    """The single-size ranking before block sizes could differ, for comparison."""
    fitting = [w for w in workers if w.unreserved_blocks >= need]
    return [
        w.address
        for w in sorted(
            fitting,
            key=lambda w: (
                weight * (len(hashes) - affinity.matched_blocks(hashes, w.address)) + w.reserved_blocks,
                w.waiting,
            ),
        )
    ]


@pytest.mark.parametrize("block_size", [16, 256])
def test_a_single_size_cluster_ranks_exactly_as_before(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(300):
        prompt_tokens = rng.randrange(0, 40 * block_size)
        hashes = [rng.randbytes(32) for _ in range(prompt_tokens // block_size)]
        projected = prompt_tokens + rng.randrange(1, 10 * block_size)
        request = RequestBlocks(prompt_tokens, projected, lambda size, hashes=hashes: hashes)
        affinity = PrefixAffinity()
        workers = [
            _view(f"w{i}", block_size, 64, reserved=rng.randrange(0, 64), waiting=rng.randrange(0, 3))
            for i in range(rng.randrange(1, 6))
        ]
        for worker in workers:
            affinity.record(hashes[: rng.randrange(0, len(hashes) + 1)], worker.address)
        weight = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0])
        expected = _old_rank(workers, request.need(block_size), hashes, affinity, weight)
        assert [w.address for w in rank_workers(workers, request, affinity, weight)] == expected


def test_router_and_a_worker_without_prefix_caching_agree_on_n_choices() -> None:
    """n = 4 on a worker that caches no prefixes: its choices share no prompt blocks, so it reserves four
    whole footprints; the router, reading the worker's published setting, counts the same (it counted the
    shared-prompt figure before, fewer blocks than the worker then reserved)."""
    from services.common.kv_blocks import request_blocks

    prompt, max_tokens, size = len(PROMPT_IDS), MAX_TOKENS, 16
    request = RequestBlocks(prompt, prompt + 4 * max_tokens, lambda s: prompt_block_hashes(PROMPT_IDS, s), n=4)
    worker_reserves = request_blocks(prompt, max_tokens, 4, size, shares_prompt=False)
    state = {
        "total_blocks": 512,
        "capacity_blocks": 512,
        "reserved_blocks": 0,
        "running": 0,
        "waiting": 0,
        "block_size": size,
        "snapshot_at": 0.0,
        "enable_prefix_caching": False,
    }

    class Published(StaticRegistry):
        def members(self, role: str, revision: str | None = None) -> list[Member]:
            return [Member("worker", "w", "r", state, 0.0)] if role == "worker" else []

    view = ClusterView(Published(), "r")  # type: ignore[arg-type]
    asyncio.run(view.refresh())
    [worker] = view.workers()
    assert not worker.enable_prefix_caching
    assert request.need_on(worker) == worker_reserves == 4 * request_blocks(prompt, max_tokens, 1, size)
    assert request.need(size) < worker_reserves  # a caching worker shares the prompt's full blocks
