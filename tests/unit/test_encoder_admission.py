"""The encoder's admission: all or nothing, by expected wait within its budget, the measured drain rate, and
the overload kinds its refusals carry."""

from __future__ import annotations

import asyncio

import pytest

from services.common import overload
from services.encoder.batcher import Batcher
from services.encoder.load import Admission, EncoderRates, Overloaded
from services.encoder.preprocess_pool import PreprocessPool


def _no_tower(inputs: list[object]) -> list[object]:
    return []  # admission only reads the batcher's queue, which these tests never fill


def run(coro):
    return asyncio.run(coro)


def test_admission_is_all_or_nothing_and_gives_everything_back() -> None:
    async def go() -> None:
        with PreprocessPool(workers=1, max_queue=3) as pool:
            batcher = Batcher(_no_tower, max_tokens=100, max_wait_s=0.0)
            admission = Admission(pool, batcher, token_cap=50, max_queue_s=60.0, rates=EncoderRates())
            first = admission.admit([10, 10])
            assert pool.outstanding == 2 and admission.snapshot().queued_tokens == 20
            with pytest.raises(Overloaded) as info:
                admission.admit([5, 5])  # 2 slots asked, 1 left: nothing taken
            assert info.value.retry_after_ms >= 20 and info.value.kind == overload.FULL
            assert pool.outstanding == 2 and admission.snapshot().queued_items == 2
            with pytest.raises(Overloaded, match="encoder tokens") as info:
                admission.admit([40])  # 20 queued + 40 > 50
            assert info.value.kind == overload.FULL
            first.finish(0)
            first.finish(0)  # idempotent
            assert pool.outstanding == 1 and admission.snapshot().queued_tokens == 10
            first.finish(1)
            assert pool.outstanding == 0 and admission.snapshot().queued_items == 0
            lone = admission.admit([500])  # above the cap but nothing queued: admitted
            lone.finish(0)
            assert admission.snapshot().as_state() == {
                "queued_items": 0,
                "queued_tokens": 0,
                "preprocess_outstanding": 0,
                "batch_queue_items": 0,
                "batch_queue_tokens": 0,
                "expected_wait_ms": 0,
                "over_budget_ms": 0,
                "token_ms": round(50 / 256, 6),  # the prior rate (nothing encoded yet), for the router's estimate
                "budget_ms": 60_000,
            }

    run(go())


def test_admission_queues_a_burst_within_the_time_budget_and_refuses_past_it() -> None:
    """An encoder draining an item every 0.05 s: sixteen items expect 0.8 s, so all are
    admitted under a 1 s budget although they pass the old four-per-process count; the next ones would
    wait past it and are refused at once as WAIT, with a hint of how long until they would fit; a
    shorter request budget (its deadline) refuses sooner. Nothing queued: any request is admitted."""

    async def go() -> None:
        with PreprocessPool(workers=2, max_queue=64) as pool:
            batcher = Batcher(_no_tower, max_tokens=100, max_wait_s=0.0)
            admission = Admission(
                pool, batcher, token_cap=10_000, max_queue_s=1.0, rates=EncoderRates(item_s=0.05, item_tokens=4)
            )
            tickets = [admission.admit([4]) for _ in range(16)]
            assert admission.snapshot().queued_items == 16 and admission.snapshot().expected_wait_ms == 800
            tickets.append(admission.admit([4, 4, 4, 4]))  # 20 items: 1.0 s, still within
            with pytest.raises(Overloaded, match="expected wait 1.10s") as info:
                admission.admit([4, 4])
            assert info.value.kind == overload.WAIT and info.value.retry_after_ms == 100
            assert pool.outstanding == 20  # the refusal took nothing
            for ticket in tickets:
                for index in range(len(ticket._tokens)):
                    ticket.finish(index)
            tickets = [admission.admit([4]) for _ in range(6)]
            with pytest.raises(Overloaded, match="budget 0.30s"):
                admission.admit([4], budget_s=0.3)  # its deadline is nearer than the encoder's budget
            for ticket in tickets:
                ticket.finish(0)
            lone = admission.admit([4] * 40, budget_s=0.01)  # nothing queued: admitted
            assert admission.snapshot().queued_items == 40
            for index in range(40):
                lone.finish(index)

    run(go())


def test_a_booked_request_is_judged_by_the_ceilings_and_its_deadline_not_the_time_budget() -> None:
    """A router that booked a request judged the encoder's time budget before placing it on a worker: the
    encoder admits it past that budget (a newer rate would refuse it after the worker reserved), still refuses
    it by its own deadline and by the count ceilings (as a backlog when it is past the budget too, so the router
    refuses it at once instead of holding it for a slot), and judges an unbooked one by the budget as before."""

    async def go() -> None:
        with PreprocessPool(workers=1, max_queue=24) as pool:
            batcher = Batcher(_no_tower, max_tokens=100, max_wait_s=0.0)
            admission = Admission(
                pool, batcher, token_cap=10_000, max_queue_s=1.0, rates=EncoderRates(item_s=0.05, item_tokens=4)
            )
            tickets = [admission.admit([4] * 20)]  # 1.0 s: the budget is full
            with pytest.raises(Overloaded, match="budget 1.00s"):
                admission.admit([4])
            tickets.append(admission.admit([4], booked=True))  # 1.05 s, past the budget: booked, admitted
            with pytest.raises(Overloaded, match="budget 0.50s") as info:
                admission.admit([4], budget_s=0.5, booked=True)  # its deadline still binds
            assert info.value.kind == overload.WAIT
            with pytest.raises(Overloaded, match="needs 4") as info:
                admission.admit([4] * 4, booked=True)  # the pool's queue (24) is a ceiling for all
            assert info.value.kind == overload.WAIT  # past the budget as well: no slot is worth waiting for
            assert admission.snapshot().queued_items == 21
            roomy = Admission(pool, batcher, token_cap=10_000, max_queue_s=60.0, rates=EncoderRates())
            tickets.append(roomy.admit([4]))
            with pytest.raises(Overloaded, match="needs 4") as info:
                roomy.admit([4] * 4, booked=True)  # within its budget: a slot frees soon, the router may hold it
            assert info.value.kind == overload.FULL
            for ticket in tickets:
                for index in range(len(ticket._tokens)):
                    ticket.finish(index)

    run(go())


def test_encoder_rates_count_busy_time_per_encoded_token() -> None:
    rates = EncoderRates(item_s=0.05, item_tokens=10, span_s=0.45, prior=2)
    rates.started(10.0, in_encoder_before=0)
    rates.started(10.0, in_encoder_before=1)  # a burst: the encoder was busy already
    assert rates.token_s(10.0) == pytest.approx(0.005)
    assert rates.token_s(10.3) == pytest.approx((0.1 + 0.3) / 30)  # no completion for 0.3 s: the rate rises
    assert rates.token_s(10.3, completing=100) == pytest.approx(0.005)  # unless a large batch is in the tower
    rates.finished(10.4, in_encoder_after=2, tokens=10, encoded=True)  # the first carries the burst's wait
    rates.finished(10.4, in_encoder_after=1, tokens=30, encoded=True)  # finished with it: no busy time of its own
    assert rates.token_s(10.4) == pytest.approx((0.1 + 0.4 + 0.0) / 60)
    rates.finished(10.5, in_encoder_after=0, tokens=10, encoded=False)  # a cache hit: no sample; idle now
    assert rates.token_s(50.0) == rates.token_s(10.4)  # idle: time passing says nothing
    rates.started(99.0, in_encoder_before=0)  # idle time never counts
    rates.finished(99.1, in_encoder_after=0, tokens=20, encoded=True)
    assert rates.token_s(99.1) == pytest.approx((0.4 + 0.0 + 0.1) / 60)  # the prior left: the rest cover 0.45 s
    assert rates.drain_s(3, 99.1) == pytest.approx(3 * rates.token_s(99.1))
    rates.started(200.0, in_encoder_before=0)
    rates.finished(215.7, in_encoder_after=1, tokens=96, encoded=True, sample=False)  # a video's decode: no sample
    rates.finished(215.8, in_encoder_after=0, tokens=20, encoded=True)  # the image after it: its own 0.1 s only
    assert rates.token_s(215.8) == pytest.approx((0.4 + 0.0 + 0.1 + 0.1) / 80)  # not (... + 15.7 + 0.1) / 176


def test_a_batch_finishing_at_once_keeps_its_call_in_the_rate() -> None:
    """A tower call that ends 64 items together gives one long sample and 63 of zero: the window, by busy time,
    keeps the long one with them, so the rate is the call's time per token, not the zeros' (a window counted in
    items once read 0.05 ms an item here and admitted a flood)."""
    rates = EncoderRates(item_s=0.05, item_tokens=10, span_s=2.0, prior=8)
    for call in range(3):
        start = 10.0 + 3.2 * call
        rates.started(start, in_encoder_before=0)
        for item in range(64):
            rates.finished(start + 3.2, in_encoder_after=63 - item, tokens=10, encoded=True)
    assert rates.token_s(20.0) == pytest.approx(3.2 / 640)


def test_small_images_are_priced_by_their_tokens_after_large_items() -> None:
    """The drain rate is per encoder token, so items much larger than a burst's (a video, many frames) set a rate
    at which the burst's small images are still admitted in proportion to their size: a per-item rate learned from
    the large ones refused eight 200x200 images in a 20 s budget once the host was loaded."""

    async def go() -> None:
        with PreprocessPool(workers=1, max_queue=64) as pool:
            batcher = Batcher(_no_tower, max_tokens=100, max_wait_s=0.0)
            rates = EncoderRates(item_s=6.0, item_tokens=3000, prior=1)  # learned from a video: 6 s, 3,000 tokens
            admission = Admission(pool, batcher, token_cap=100_000, max_queue_s=20.0, rates=rates)
            held = admission.admit([3000])  # another video: 6 s queued
            small = [admission.admit([49]) for _ in range(8)]  # 8 x 49 tokens: 0.8 s more (48 s at 6 s an item)
            assert admission.snapshot().queued_items == 9
            for ticket in (held, *small):
                ticket.finish(0)

    run(go())


def test_encoded_items_teach_admission_its_rate() -> None:
    async def go() -> None:
        with PreprocessPool(workers=1, max_queue=8) as pool:
            batcher = Batcher(_no_tower, max_tokens=100, max_wait_s=0.0)
            rates = EncoderRates(item_s=99.0, item_tokens=4, span_s=1.0, prior=1)
            admission = Admission(pool, batcher, token_cap=1000, max_queue_s=60.0, rates=rates)
            ticket = admission.admit([4, 4])
            ticket.finish(0)  # a cache hit or a failure: says nothing about the rate
            assert rates.token_s(0.0) == 99.0 / 4  # nothing in the encoder: not busy, so time does not count
            ticket.finish(1, encoded=True)
            assert rates.token_s(0.0) < 99.0 / 4  # the encoded item's own (short) busy time joined the window

    run(go())


def test_overload_metadata_round_trips_and_defaults_to_wait() -> None:
    assert overload.read(overload.trailing(250, overload.FULL)) == (250, overload.FULL)
    assert overload.read((("retry-after-ms", "40"),)) == (40, overload.WAIT)  # an older encoder
    assert overload.read((("retry-after-ms", "x"), ("epd-overload", "odd"))) == (500, overload.WAIT)


def test_an_item_waiting_for_another_encoder_is_no_busy_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """An item whose image another encoder is producing waits (up to the lock's TTL when that encoder died) without
    being this encoder's work: the wait neither raises the drain rate while it lasts, refusing the requests behind
    it, nor becomes the sample of the item once it encodes after all. Counted as busy, 30 s of waiting priced 4
    tokens at 30 s and refused everything for as long as that sample stayed."""
    clock = [100.0]
    monkeypatch.setattr("services.encoder.load.time.monotonic", lambda: clock[0])

    async def go() -> None:
        with PreprocessPool(workers=1, max_queue=8) as pool:
            batcher = Batcher(_no_tower, max_tokens=100, max_wait_s=0.0)
            rates = EncoderRates(item_s=0.05, item_tokens=4, prior=8)
            admission = Admission(pool, batcher, token_cap=10_000, max_queue_s=1.0, rates=rates)
            prior = rates.token_s(clock[0])
            waiter = admission.admit([4])
            with waiter.waiting_for_peer():
                clock[0] += 30.0  # the peer died holding the lock: its TTL runs out
                assert rates.token_s(clock[0]) == prior
                other = admission.admit([4])  # admitted: the queue's expected wait is its own few tokens
                clock[0] += 0.05
                other.finish(0, encoded=True)
                assert rates.token_s(clock[0]) == pytest.approx((8 * 0.05 + 0.05) / (9 * 4))
            clock[0] += 0.05  # the lock is gone without an embedding: the waiter encodes it itself
            waiter.finish(0, encoded=True)
            assert rates.token_s(clock[0]) == pytest.approx((8 * 0.05 + 0.1) / (10 * 4))
            assert admission.snapshot().queued_items == 0 and admission.expected_wait_s() == 0

    run(go())
