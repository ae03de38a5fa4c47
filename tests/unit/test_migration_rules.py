"""The router's migration rules (services/router/migration.py) and the drain counter (services/common/drain.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.drain import Drain, drained
from services.common.rpc.epd.v1 import common_pb2, worker_pb2
from services.router.errors import RequestError
from services.router.migration import Migrations, Progress, WorkerLost, continuation


def _base() -> worker_pb2.WorkerRequest:
    sampling = common_pb2.SamplingParams(max_tokens=10, temperature=0.7, seed=5, stop=["x"])
    return worker_pb2.WorkerRequest(request_id="r", token_ids=[1, 2, 3], sampling=sampling, cache_salt="s")


def test_continuation_is_prompt_plus_streamed_tokens_with_the_remaining_budget() -> None:
    progress = Progress(1)
    assert continuation(_base(), progress, 0) == _base()
    fresh = continuation(_base(), progress, 1)  # nothing streamed yet: the same request under a new id
    assert fresh.request_id == "r~m1" and list(fresh.token_ids) == [1, 2, 3] and fresh.sampling.max_tokens == 10
    progress.add(0, [7, 8])
    progress.add(0, [9])
    moved = continuation(_base(), progress, 2)
    assert moved.request_id == "r~m2" and list(moved.token_ids) == [1, 2, 3, 7, 8, 9]
    assert (fresh.generated_tokens, moved.generated_tokens) == (0, 3)  # the worker positions them as decoded text
    assert moved.sampling.max_tokens == 7 and moved.sampling.seed == 5 and moved.cache_salt == "s"
    assert list(moved.sampling.stop) == ["x"] and moved.sampling.temperature == pytest.approx(0.7)


def test_migrations_stop_at_the_limit_naming_the_worker_and_the_count() -> None:
    counted: list[str] = []
    migrations = Migrations(2, counted.append)
    progress = Progress(1)
    progress.add(0, [4])
    for reason in ("unavailable", "drain"):
        migrations.next(WorkerLost("w:1", reason, "gone"), progress)
    assert counted == ["unavailable", "drain"] and migrations.done == 2
    with pytest.raises(RequestError) as refused:
        migrations.next(WorkerLost("w:2", "internal", "INTERNAL: boom"), progress)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "worker w:2 failed" in refused.value.message and "moved 2 time(s)" in refused.value.message
    assert counted == ["unavailable", "drain"]


def test_several_choices_move_only_before_their_first_token() -> None:
    counted: list[str] = []
    migrations = Migrations(3, counted.append)
    progress = Progress(2)
    migrations.next(WorkerLost("w:1", "unavailable", "gone"), progress)
    progress.add(1, [3])
    with pytest.raises(RequestError, match="n=2 choices cannot move"):
        migrations.next(WorkerLost("w:2", "unavailable", "gone"), progress)
    assert counted == ["unavailable"]


def test_drain_refuses_new_work_and_waits_for_the_work_in_flight() -> None:
    async def scenario() -> None:
        drain = Drain()
        assert drain.enter() and drain.enter() and drain.in_flight == 2
        drain.start()
        assert not drain.enter() and drain.in_flight == 2
        ended: list[bool] = []
        drain.leave()
        assert not await drained(drain, 0, lambda: ended.append(True), settle_s=0)
        assert ended == [True] and drain.in_flight == 1  # one still ran at the timeout: it was told to end
        waiting = asyncio.create_task(drain.wait_idle(600))
        await asyncio.sleep(0)
        drain.leave()
        assert await waiting
        assert await drain.wait_idle(0) and await drained(drain, 0, lambda: ended.append(False))
        with pytest.raises(RuntimeError):
            drain.leave()

    asyncio.run(scenario())
