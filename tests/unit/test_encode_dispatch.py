"""The router's encode dispatch against real gRPC encoders that refuse: a momentary refusal (a count
ceiling) is held and retried, a backlog past the encoder's budget is refused at once, a hold never
outlasts its bound. The encoders are servicers in this process that answer as a busy encoder does."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from services.common import overload
from services.common.embedding_cache import CacheSettings, EmbeddingCache
from services.common.grpc_server import ServiceBinding, start_server
from services.common.registry import Registry
from services.common.rpc.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.router.cluster_view import ClusterView
from services.router.encode_dispatch import EncodeDispatcher, media_sources
from services.router.errors import RequestError
from tests.redis_server import RedisServer
from tests.static_registry import StaticRegistry


class BusyEncoder(encoder_pb2_grpc.EncoderServicer):
    """Refuses the first `refusals` calls with `kind`, then encodes (answers ok)."""

    def __init__(self, refusals: int, kind: str, retry_after_ms: int = 20) -> None:
        self.refusals = refusals
        self.kind = kind
        self.retry_after_ms = retry_after_ms
        self.calls = 0

    async def Encode(self, request, context):  # noqa: N802 (gRPC's name)
        self.calls += 1
        if self.calls <= self.refusals:
            context.set_trailing_metadata(overload.trailing(self.retry_after_ms, self.kind))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy ({self.kind})")
        return encoder_pb2.EncodeResponse(encoded=len(request.items))


@pytest.fixture(scope="module")
def cache(redis_server: RedisServer) -> Iterator[EmbeddingCache]:
    cache = EmbeddingCache(CacheSettings(redis_server.url, "dispatch-test", max_bytes=0))
    yield cache
    cache.close()


def _dispatch(cache: EmbeddingCache, redis_url: str, encoder: BusyEncoder, hold_s: float) -> tuple[float, int]:
    """One request with one fresh item through a dispatcher whose only encoder is `encoder`;
    (seconds it took, the encoder's calls). Raises what the dispatcher raised."""

    async def go() -> float:
        binding = ServiceBinding(encoder_pb2_grpc.add_EncoderServicer_to_server, encoder, "epd.v1.Encoder")
        server = await start_server("127.0.0.1", 0, [binding])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        view = ClusterView(Registry(redis_url), "dispatch-test")  # never started: the static list serves
        dispatcher = EncodeDispatcher(view, cache, lambda _: channel, [f"127.0.0.1:{server.port}"], hold_s=hold_s)
        ref = common_pb2.MediaRef(mm_hash=uuid.uuid4().hex, num_tokens=4)
        try:
            start = time.monotonic()
            await dispatcher.encode("r1", [ref], [b"image"], "127.0.0.1:1", time.monotonic() + 60)
            return time.monotonic() - start
        finally:
            await channel.close()
            await server.stop()

    seconds = asyncio.run(go())
    return seconds, encoder.calls


def test_a_full_encoder_holds_the_request_until_it_has_room(cache: EmbeddingCache, redis_server: RedisServer) -> None:
    encoder = BusyEncoder(refusals=3, kind=overload.FULL, retry_after_ms=20)
    seconds, calls = _dispatch(cache, redis_server.url, encoder, hold_s=60)
    assert calls == 4  # three refusals waited out, then encoded
    assert seconds >= 0.06  # it waited each hint before trying again


def test_a_backlog_past_the_budget_is_refused_at_once(cache: EmbeddingCache, redis_server: RedisServer) -> None:
    encoder = BusyEncoder(refusals=100, kind=overload.WAIT, retry_after_ms=3000)
    with pytest.raises(RequestError) as info:
        _dispatch(cache, redis_server.url, encoder, hold_s=60)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "every encoder is busy (busy (wait))" in str(info.value)
    assert encoder.calls == 1  # no hold: refused on the first answer
    assert dict(info.value.metadata)["retry-after-ms"] == "3000"


def test_a_hold_ends_at_its_bound(cache: EmbeddingCache, redis_server: RedisServer) -> None:
    encoder = BusyEncoder(refusals=1000, kind=overload.FULL, retry_after_ms=50)
    with pytest.raises(RequestError) as info:
        _dispatch(cache, redis_server.url, encoder, hold_s=0.3)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 1 <= encoder.calls <= 7  # held at most 0.3 s at 50 ms or more a try, then refused


def test_every_encoder_past_its_budget_refuses_before_any_call(cache: EmbeddingCache) -> None:
    """The encoders' published backlog past their budget (heartbeat state `over_budget_ms`): when every one is
    past it, a request with images to encode is refused at once, before any worker reserves blocks; one encoder
    with room, or nothing to encode, and it goes on."""
    from services.common.registry import Member

    states = {"e1": {"queued_tokens": 0, "over_budget_ms": 800}, "e2": {"queued_tokens": 0, "over_budget_ms": 300}}

    class Published(StaticRegistry):
        def members(self, role: str, revision: str | None = None) -> list[Member]:
            return [Member("encoder", a, "r", s, 0.0) for a, s in states.items()] if role == "encoder" else []

    view = ClusterView(Published(), "r")  # type: ignore[arg-type]
    asyncio.run(view.refresh())
    dispatcher = EncodeDispatcher(view, cache, lambda _: None, [])  # type: ignore[arg-type, return-value]
    item = encoder_pb2.EncodeItem(ref=common_pb2.MediaRef(mm_hash="h", num_tokens=4), data=b"x")
    with pytest.raises(RequestError) as info:
        dispatcher.check_room([item])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "every encoder is busy" in str(info.value)
    assert dict(info.value.metadata)["retry-after-ms"] == "300"  # the sooner of the two
    dispatcher.check_room([])  # all cached: no encoder needed
    states["e2"]["over_budget_ms"] = 0
    asyncio.run(view.refresh())
    dispatcher.check_room([item])  # e2 admits again


def _published_encoder(state: dict) -> tuple[ClusterView, EncodeDispatcher]:
    """A dispatcher whose view holds one encoder, `e1`, publishing `state` (read again at each `view.refresh()`)."""
    from services.common.registry import Member

    class Published(StaticRegistry):
        def members(self, role: str, revision: str | None = None) -> list[Member]:
            return [Member("encoder", "e1", "r", dict(state), time.time())] if role == "encoder" else []

    view = ClusterView(Published(), "r")  # type: ignore[arg-type]
    asyncio.run(view.refresh())
    return view, EncodeDispatcher(view, None, lambda _: None, [])  # type: ignore[arg-type, return-value]


def items(n: int, size: int = 4) -> list[encoder_pb2.EncodeItem]:
    """`n` items of `size` encoder tokens each (hashes h0, h1, ...)."""
    return [encoder_pb2.EncodeItem(ref=common_pb2.MediaRef(mm_hash=f"h{i}", num_tokens=size)) for i in range(n)]


def test_the_router_counts_what_it_booked_since_the_encoders_heartbeat() -> None:
    """An encoder publishing its queue, drain rate and budget is judged as it judges itself, with the tokens this
    router booked on it added (each request's at once, so requests checked meanwhile see them): a burst is refused at
    the router once its own bookings would pass the budget, before any worker or encoder call; a booking given back
    no longer counts. A booking whose Encode call has not started (its request waits for a worker's blocks) counts
    whatever the heartbeats say, up to `UNSENT_TTL_S`; once its call started, the next heartbeat (which counts
    admitted items itself) replaces it, and without heartbeats the backlog drains at one second a second."""
    from services.common.registry import Member
    from services.router.cluster_view import UNSENT_TTL_S

    published = {"at": 1.0, "state": {"queued_tokens": 0, "token_ms": 25.0, "budget_ms": 1000, "over_budget_ms": 0}}

    class Published(StaticRegistry):
        def members(self, role: str, revision: str | None = None) -> list[Member]:
            if role != "encoder":
                return []
            return [Member("encoder", "e1", "r", dict(published["state"]), published["at"])]

    def heartbeat(at: float, queued: int) -> None:
        published.update(at=at, state={**published["state"], "queued_tokens": queued})
        asyncio.run(view.refresh())

    now = [100.0]
    view = ClusterView(Published(), "r", clock=lambda: now[0])  # type: ignore[arg-type]
    asyncio.run(view.refresh())
    dispatcher = EncodeDispatcher(view, None, lambda _: None, [])  # type: ignore[arg-type, return-value]

    first = dispatcher.check_room(items(3))  # nothing queued: anything is admitted; 3 items of 4 tokens booked
    assert first.tokens == {"e1": 12}
    second = dispatcher.check_room(items(5))  # (3 + 5) x 4 x 25 ms = 0.8 s: within the budget
    with pytest.raises(RequestError) as info:
        dispatcher.check_room(items(3))  # (8 + 3) x 100 ms = 1.1 s
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "encoders_busy"
    assert dict(info.value.metadata)["retry-after-ms"] == "100"  # how far past the budget
    dispatcher.release(first)  # that request went no further
    third = dispatcher.check_room(items(3))  # (5 + 3) x 100 ms
    heartbeat(2.0, 0)  # the encoder has seen none of them: its heartbeat does not make them go
    with pytest.raises(RequestError):
        dispatcher.check_room(items(3))  # (8 + 3) x 100 ms
    dispatcher._sending(second, "e1")  # their calls start: the encoder's to count from now on
    dispatcher._sending(third, "e1")
    assert view.note_unbooked("e1", second) == 0
    now[0] += 0.9  # heartbeats come every 0.2 s and will say what drained: nothing is taken off meanwhile
    with pytest.raises(RequestError):
        dispatcher.check_room(items(3))  # (8 + 3) x 100 ms
    now[0] += 0.25  # but one over a second old has stopped: its queue drains from then on (150 ms here)
    with pytest.raises(RequestError):
        dispatcher.check_room(items(4))  # (8 + 4) x 100 - 150 ms
    fourth = dispatcher.check_room(items(3))  # (8 + 3) x 100 - 150 ms
    dispatcher._sending(fourth, "e1")
    heartbeat(3.0, 12)  # its next heartbeat
    dispatcher.check_room(items(2))  # (3 + 2) x 100 ms: what it reports replaces what was sent
    with pytest.raises(RequestError):
        dispatcher.check_room(items(6))  # (3 + 2 + 6) x 100 ms: the 2 are booked, not sent
    now[0] += UNSENT_TTL_S  # a booking neither sent nor given back (a request that vanished) stops counting
    heartbeat(4.0, 12)
    dispatcher.check_room(items(6))  # (3 + 6) x 100 ms
    now[0] += 60.0  # no heartbeat for a minute (Redis down, say): what was sent has drained meanwhile, and the
    asyncio.run(view.refresh())  # 6 booked unsent before have passed their TTL (the refresh runs, Redis or not)
    dispatcher.check_room(items(6))


def test_a_request_with_unknown_images_is_refused_before_it_is_prepared() -> None:
    """With no encoder's room, `precheck` refuses a request carrying an image this router never found
    cached, from its bytes as sent (nothing decoded or hashed for the model); one whose image it found cached goes
    on to the real lookup, text goes on, and the same image sent by another tenant is another tenant's item."""
    from services.client import user_request
    from services.common.registry import Member

    state = {"queued_tokens": 1000, "token_ms": 25.0, "budget_ms": 20_000, "over_budget_ms": 5_000, "at": 1.0}

    class Published(StaticRegistry):
        def members(self, role: str, revision: str | None = None) -> list[Member]:
            return [Member("encoder", "e1", "r", dict(state), state["at"])] if role == "encoder" else []

    view = ClusterView(Published(), "r")  # type: ignore[arg-type]
    asyncio.run(view.refresh())
    dispatcher = EncodeDispatcher(view, None, lambda _: None, [])  # type: ignore[arg-type, return-value]
    seen, fresh = user_request("a", [b"\x89PNG seen"]), user_request("b", [b"\x89PNG fresh"])
    assert media_sources(seen, "t1") != media_sources(fresh, "t1")
    assert media_sources(seen, "t1") == media_sources(user_request("other text", [b"\x89PNG seen"]), "t1")
    dispatcher.remember(media_sources(seen, "t1"))
    dispatcher.precheck(media_sources(seen, "t1"))  # found cached before: on to the real lookup
    dispatcher.precheck(media_sources(user_request("text only"), "t1"))
    for request, tenant in ((fresh, "t1"), (seen, "t2")):
        with pytest.raises(RequestError) as info:
            dispatcher.precheck(media_sources(request, tenant))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.reason == "encoders_busy"
    state.update(queued_tokens=40, at=2.0)  # its next heartbeat: room again
    asyncio.run(view.refresh())
    dispatcher.precheck(media_sources(fresh, "t1"))


def test_the_call_to_the_encoder_this_router_booked_says_so(cache: EmbeddingCache) -> None:
    """`check_room` judged the owner's time budget before placement, so the Encode call to the owner says `booked`
    (the encoder then judges only its ceilings and the deadline); the same request failed over to another encoder
    was judged by nobody there, so that call does not."""
    from services.common.registry import Member

    class Recording(BusyEncoder):
        def __init__(self, fail: bool) -> None:
            super().__init__(refusals=0, kind=overload.WAIT)
            self.fail = fail
            self.booked: list[bool] = []

        async def Encode(self, request, context):  # noqa: N802 (gRPC's name)
            self.booked.append(request.booked)
            if self.fail:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")
            return encoder_pb2.EncodeResponse(encoded=len(request.items))

    async def go() -> dict[str, Recording]:
        servers, encoders = [], {}
        for fail in (True, False):
            encoder = Recording(fail)
            binding = ServiceBinding(encoder_pb2_grpc.add_EncoderServicer_to_server, encoder, "epd.v1.Encoder")
            server = await start_server("127.0.0.1", 0, [binding])
            servers.append(server)
            encoders[f"127.0.0.1:{server.port}"] = encoder
        state = {"queued_tokens": 0, "token_ms": 25.0, "budget_ms": 1000, "over_budget_ms": 0}

        class Published(StaticRegistry):
            def members(self, role: str, revision: str | None = None) -> list[Member]:
                return (
                    [Member("encoder", a, "r", dict(state), time.time()) for a in encoders] if role == "encoder" else []
                )

        view = ClusterView(Published(), "r")  # type: ignore[arg-type]
        await view.refresh()
        channels = {address: grpc.aio.insecure_channel(address) for address in encoders}
        dispatcher = EncodeDispatcher(view, cache, channels.__getitem__, [])
        # an image whose owner (rendezvous hashing) is the failing encoder
        failing = next(a for a, e in encoders.items() if e.fail)
        ref = next(
            r
            for r in (common_pb2.MediaRef(mm_hash=uuid.uuid4().hex, num_tokens=4) for _ in range(100))
            if dispatcher.check_room([encoder_pb2.EncodeItem(ref=r)]).tokens == {failing: 4}
        )
        item = encoder_pb2.EncodeItem(ref=ref, data=b"image")
        booking = dispatcher.check_room([item])
        try:
            await dispatcher.encode_items("r1", [item], "127.0.0.1:1", time.monotonic() + 60, booking)
            assert all(view.note_unbooked(a, booking) == 0 for a in encoders)  # nothing left counted as unsent
        finally:
            for channel in channels.values():
                await channel.close()
            for server in servers:
                await server.stop()
        return encoders

    encoders = asyncio.run(go())
    assert [e.booked for e in encoders.values()] == [[True], [False]]  # the owner booked; the failover not


def test_precheck_counts_the_requests_it_let_by_until_they_book() -> None:
    """A burst's requests all pass `precheck` before any of them reaches `check_room` (their images are decoded,
    hashed and looked up in between, hundreds of milliseconds in a burst): each one's unknown items count as pending
    on the encoders, at the median tokens of the items booked last (none yet: nothing), so the burst is refused on
    arrival once those would pass the budget, not at `check_room` after its intake; `check_room` replaces them with
    the real booking, and `settle` gives back a request's that ended."""
    state = {"queued_tokens": 4, "token_ms": 25.0, "budget_ms": 850, "over_budget_ms": 0}
    _, dispatcher = _published_encoder(state)
    sources = [[f"s{r}-{i}" for i in range(3)] for r in range(4)]
    assert dispatcher.precheck(sources[0]).tokens == 0  # no item booked yet: their size is not known
    dispatcher.release(dispatcher.check_room(items(1)))  # one 4-token item booked (and given back)
    first = dispatcher.precheck(sources[0])  # (4 + 3 x 4) x 25 ms
    second = dispatcher.precheck(sources[1])  # (4 + 12 pending + 12) x 25 ms
    with pytest.raises(RequestError) as info:
        dispatcher.precheck(sources[2])  # (4 + 24 pending + 12) x 25 ms past 850: refused on arrival
    assert info.value.reason == "encoders_busy"
    dispatcher.settle(first)  # that request ended before booking (a bad prompt, say)
    dispatcher.settle(first)  # idempotent
    third = dispatcher.precheck(sources[2])  # (4 + 12 + 12) x 25 ms
    dispatcher.check_room(items(2), second)  # one of its three found cached: two booked, its pending settled
    assert (second.tokens, third.tokens) == (0, 12)
    dispatcher.precheck([])  # nothing unknown: nothing counted, nothing refused
    with pytest.raises(RequestError):
        dispatcher.precheck(sources[3])  # (4 + 8 booked + 12 pending + 12) x 25 ms
    dispatcher.settle(third)
    assert dispatcher.precheck(sources[3]).tokens == 12  # (4 + 8 + 12) x 25 ms


def test_a_request_judged_on_arrival_is_not_judged_again_when_it_books() -> None:
    """The drain rate moves by several times within a burst, so a request `precheck` let by on arrival could be
    refused at `check_room` after its intake and lookup (the slowest refusals of an overload): when its items are
    no more tokens than `precheck` counted for it, it books without a second judgement; more tokens than counted,
    or no count at all (no item booked yet), and it is judged."""
    state = {"queued_tokens": 4, "token_ms": 25.0, "budget_ms": 850, "over_budget_ms": 0}
    view, dispatcher = _published_encoder(state)
    unjudged = dispatcher.precheck(["s0"])  # no item booked yet: counted at nothing
    dispatcher.release(dispatcher.check_room(items(1), unjudged))  # one 4-token item booked (and given back)
    passed = [dispatcher.precheck([f"s{r}"]) for r in range(1, 4)]  # each (4 + pending + 4) x 25 ms: admitted
    state["token_ms"] = 400.0  # the next heartbeat: the rate rose (4 + 4) x 400 ms past 850
    asyncio.run(view.refresh())
    booking = dispatcher.check_room(items(1), passed[0])  # its 4 tokens were judged on arrival: booked
    assert booking.tokens == {"e1": 4}
    with pytest.raises(RequestError) as info:
        dispatcher.check_room(items(1, size=8), passed[1])  # 8 tokens against the 4 counted: judged, refused
    assert info.value.reason == "encoders_busy"
    assert passed[1].tokens == 0  # settled all the same
    with pytest.raises(RequestError):
        dispatcher.check_room(items(1))  # not let by `precheck`: judged
    with pytest.raises(RequestError):
        dispatcher.precheck(["s9"])  # arrivals from now on are judged at the new rate
    dispatcher.settle(passed[2])
