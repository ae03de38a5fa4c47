"""Sending a request's uncached media items to encoders, with failover.

Each item goes to the encoder that owns its `mm_hash` by rendezvous hashing over the registered
encoders (so one image meets one encoder cluster-wide and is encoded once), with the admitted
worker as destination. An encoder that is unreachable or fails is skipped and the items go to the
next one; when none is left, the worker encodes them itself (co-located fallback: every worker also
serves `epd.v1.Encoder`). Bad media (INVALID_ARGUMENT) fails the request at once.

Busy encoders: an encoder admits by expected wait and refuses with `epd-overload: wait` when its
backlog passes its time budget; then the client gets RESOURCE_EXHAUSTED at once, with the encoders'
`retry-after-ms` (overload is a fast refusal, never pushed onto a worker). Before that, `check_room`
judges each encoder as it would judge itself, from its heartbeat (queued encoder tokens, drain rate per
token, budget) plus the tokens this router counted on it since: when none has room the request is refused
before any worker reserves blocks or any bytes are sent; otherwise its items are counted on their owners at once (a
`Booking`, taken back when an owner refuses them or the request goes no further; a request `precheck` judged on
arrival at no fewer tokens than it books is not judged again), and the Encode call
to an owner says `booked`: the time budget was judged here, before placement, so the encoder judges only
its count ceilings and the deadline (a refusal after a worker's reservation is a slow one). A refusal by a count
ceiling (`epd-overload: full`) is momentary: the request is held and tried again after the hint,
for at most `hold_s` in all and never past its deadline, as requests wait for KV blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common import overload
from services.common.embedding_cache import EmbeddingCache
from services.common.placement_hash import group_by_encoder
from services.common.rpc.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, generation_pb2
from services.router.admission import Rejection
from services.router.cluster_view import ClusterView
from services.router.errors import RequestError, invalid, unavailable
from services.router.request_record import note_encoder

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)


@dataclass(frozen=True)
class Failure:
    """Why one place could not encode: a description, and when it was only busy the retry hint and
    the kind of its overload (`overload.WAIT` or `overload.FULL`)."""

    text: str
    retry_after_ms: int | None = None
    kind: str = ""
    busy: str = ""  # the encoder's own words for its overload (no address: the client may see it)


@dataclass(eq=False)
class Booking:
    """The encoder tokens `check_room` counted on each owner's queue for one request, until an owner refuses them;
    unsent (`ClusterView.note_booked`) until the Encode call to that owner starts: its heartbeats count only that."""

    tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class Pending:
    """The encoder tokens a request that passed `precheck` may book (its unknown items at the estimate of one):
    counted on the encoders until `check_room` books the real ones or the request ends first (`settle`;
    idempotent)."""

    tokens: float = 0.0


@dataclass
class EncodeReport:
    """Where a request's encoding went: seconds in all (0 when every item was cached) and per stage."""

    seconds: float = 0.0
    stages: common_pb2.EncodeStages = field(default_factory=common_pb2.EncodeStages)

    def add(self, stages: common_pb2.EncodeStages) -> None:
        """One encoder's stages: per stage the slowest (the groups run side by side)."""
        for descriptor in stages.DESCRIPTOR.fields:
            name = descriptor.name
            setattr(self.stages, name, max(getattr(self.stages, name), getattr(stages, name)))


KNOWN_CACHED = 4096
"""Media sources remembered as cached (`EncodeDispatcher.remember`), most recent first kept."""
RECENT_ITEMS = 64
"""Items booked last whose tokens give `precheck` its estimate of an item not yet counted (their median)."""


def media_sources(request: generation_pb2.GenerateRequest, tenant: str) -> list[str]:
    """One key per media item of `request`, in prompt order, from its bytes or URL as sent (a sha256 of the
    tenant and the source, no decoding): cheap enough to take before the request is prepared."""
    keys = []
    for message in request.messages:
        for part in message.content:
            kind = part.WhichOneof("part")
            if kind not in ("image", "video"):
                continue
            media = getattr(part, kind)
            source = media.data if media.WhichOneof("source") == "data" else media.url.encode()
            digest = hashlib.sha256(tenant.encode() + b"\0" + kind.encode() + b"\0")
            digest.update(source)
            keys.append(digest.hexdigest())
    return keys


class EncodeDispatcher:
    def __init__(
        self,
        view: ClusterView,
        cache: EmbeddingCache,
        channel: Callable[[str], grpc.aio.Channel],
        static_encoders: list[str],
        on_lookup: Callable[[int, int], None] = lambda queries, hits: None,
        hold_s: float = 2.0,
    ) -> None:
        self._on_lookup = on_lookup
        self._hold_s = hold_s
        self._view = view
        self._cache = cache
        self._channel = channel
        self._static = static_encoders
        self._cached_sources: OrderedDict[str, None] = OrderedDict()  # `media_sources` keys found cached
        self._pending = 0.0  # tokens of requests past `precheck` and not yet at `check_room` (`Pending`)
        self._recent: deque[int] = deque(maxlen=RECENT_ITEMS)  # the tokens of the items booked last

    def _encoders(self) -> list[str]:
        return [e.address for e in self._view.encoders()] or list(self._static)

    async def uncached(self, refs: list[common_pb2.MediaRef], data: list[bytes]) -> list[encoder_pb2.EncodeItem]:
        """The items whose embeddings the cache does not hold (what an encoder must make)."""
        if not refs:
            return []
        cached = await asyncio.to_thread(self._cache.contains, [r.mm_hash for r in refs])
        self._on_lookup(len(refs), sum(cached))
        return [
            encoder_pb2.EncodeItem(ref=ref, data=blob)
            for ref, blob, hit in zip(refs, data, cached, strict=True)
            if not hit
        ]

    def precheck(self, sources: list[str]) -> Pending:
        """Before a request is prepared (its media decoded, hashed and looked up): refuse it at once, as
        `check_room` would, when it carries media not known to be cached (`remember`) and no encoder would
        admit them beside the requests that passed here and have not reached `check_room` yet (spread over the
        encoders, as their owners are). Their sizes are not known yet: each unknown item counts as the median of
        the items booked last (none booked yet: nothing, so only a backlog already past the budget refuses).
        An overloaded router then spends nothing on the requests it must refuse, and a request whose images this
        router saw cached goes on to the real lookup. Returns what it counted for this request: pass it to
        `check_room`, and to `settle` when the request ends."""
        unknown = sum(1 for key in sources if key not in self._cached_sources)
        encoders = self._view.encoders()
        if not unknown or not encoders:
            return Pending()
        tokens = unknown * (statistics.median_low(self._recent) if self._recent else 0)
        pending = self._pending / len(encoders)
        _refuse_when_all_past([e.past_budget_ms(tokens, pending) for e in encoders])
        self._pending += tokens
        return Pending(tokens)

    def settle(self, pending: Pending) -> None:
        """`pending`'s tokens no longer wait to be booked (booked, found cached, or the request ended)."""
        self._pending -= pending.tokens
        pending.tokens = 0.0

    def remember(self, sources: list[str]) -> None:
        """These media sources' embeddings are cached (looked up, or just encoded): `precheck` lets them by."""
        for key in sources:
            self._cached_sources[key] = None
            self._cached_sources.move_to_end(key)
        while len(self._cached_sources) > KNOWN_CACHED:
            self._cached_sources.popitem(last=False)

    def check_room(self, items: list[encoder_pb2.EncodeItem], pending: Pending | None = None) -> Booking:
        """Refuse at once (RESOURCE_EXHAUSTED, before any worker reserves blocks) when there are items to encode
        and every registered encoder's backlog, as last published plus what this router sent it since, would be
        past its time budget with them; the encoders still decide (other routers send to them too). Otherwise
        the items are counted on their owners at once (so requests checked meanwhile see them): pass the booking
        to `encode_items`, or to `release` when the request goes no further. `pending`, from `precheck`, is settled
        first: these items replace it. A request whose items `precheck` already counted in full (no more tokens than
        its estimate) is not judged again: the budget was judged on its arrival, and the drain rate moving by
        several times within a burst between the two checks refused requests here after their intake and lookup,
        the slowest refusals of an overload."""
        judged = pending.tokens if pending is not None else 0.0
        if pending is not None:
            self.settle(pending)
        encoders = self._view.encoders()
        if not items or not encoders:
            return Booking()
        tokens = [max(1, item.ref.num_tokens) for item in items]
        total = sum(tokens)
        if total > judged:
            _refuse_when_all_past([e.past_budget_ms(total) for e in encoders])
        groups = group_by_encoder([item.ref.mm_hash for item in items], [e.address for e in encoders])
        booking = Booking({owner: sum(tokens[i] for i in indexes) for owner, indexes in groups.items()})
        for owner, count in booking.tokens.items():
            self._view.note_booked(owner, booking, count)
        self._recent.extend(tokens)
        return booking

    def release(self, booking: Booking, address: str | None = None) -> None:
        """Take back what `booking` counted (on `address` only, when given): those items were not admitted."""
        for owner in [address] if address is not None else list(booking.tokens):
            count = booking.tokens.pop(owner, 0)
            if count and not self._view.note_unbooked(owner, booking):
                self._view.note_sent(owner, -count)  # its call had started: counted until the next heartbeat

    def _sending(self, booking: Booking, address: str) -> None:
        """The Encode call to `address` starts: what `booking` counted there is now the encoder's to publish."""
        count = self._view.note_unbooked(address, booking)
        if count:
            self._view.note_sent(address, count)

    async def encode(
        self, request_id: str, refs: list[common_pb2.MediaRef], data: list[bytes], worker: str, deadline: float
    ) -> EncodeReport:
        """Make every item's embedding reach `worker`; returns where the time went."""
        return await self.encode_items(request_id, await self.uncached(refs, data), worker, deadline)

    async def encode_items(
        self,
        request_id: str,
        items: list[encoder_pb2.EncodeItem],
        worker: str,
        deadline: float,
        booking: Booking | None = None,
    ) -> EncodeReport:
        """Make the embeddings of `items` (see `uncached`; `booking` from `check_room`) reach `worker`; returns
        where the time went."""
        booking = booking or Booking()
        report = EncodeReport()
        if not items:
            return report
        start = time.perf_counter()
        encoders = self._encoders()
        groups = group_by_encoder([item.ref.mm_hash for item in items], encoders) if encoders else {worker: []}
        calls = [
            self._encode_group(
                request_id, [items[i] for i in indexes] or items, owner, encoders, worker, deadline, report, booking
            )
            for owner, indexes in groups.items()
        ]
        try:
            await asyncio.gather(*calls)
        finally:
            for owner in list(booking.tokens):  # an owner never called (failed over, or cancelled first)
                if self._view.note_unbooked(owner, booking):
                    booking.tokens.pop(owner, None)
        report.seconds = time.perf_counter() - start
        return report

    async def _encode_group(
        self,
        request_id: str,
        items: list[encoder_pb2.EncodeItem],
        owner: str,
        encoders: list[str],
        worker: str,
        deadline: float,
        report: EncodeReport,
        booking: Booking,
    ) -> None:
        """Encode on the items' owner (rendezvous hashing: one image meets one encoder cluster-wide),
        failing over to the other encoders, then to the worker itself (co-located encoding)."""
        request = encoder_pb2.EncodeRequest(request_id=request_id, items=items, destination=worker)
        places = list(dict.fromkeys([owner, *encoders])) if encoders else []
        booked = set(booking.tokens)  # `check_room` judged these encoders' time budgets (a refusal un-counts)
        held_from = time.monotonic()
        held_until = min(deadline, held_from + self._hold_s)
        while True:
            held_s = time.monotonic() - held_from  # 0 on the first round
            failures: list[Failure] = []
            for encoder in places:
                request.booked = encoder in booked
                failure = await self._try(encoder, request, deadline, report, booking)
                if failure is None:
                    report.stages.held_s = max(report.stages.held_s, held_s)
                    return
                failures.append(failure)
            hints = [f.retry_after_ms for f in failures if f.retry_after_ms is not None]
            if not failures or len(hints) < len(failures):
                break
            # every encoder is busy: overload is refused, not pushed onto the worker (decode stays flat)
            retry_s = min(hints) / 1000
            backlog = any(f.kind != overload.FULL for f in failures)
            if backlog or time.monotonic() + retry_s > held_until:
                raise Rejection(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"every encoder is busy ({failures[0].busy}); retry later",
                    "encoder_backlog" if backlog else "encoder_full_after_wait",
                    max(hints),
                )
            await asyncio.sleep(retry_s)  # a count ceiling: momentary, so the request waits its turn
        request.booked = False
        failure = await self._try(worker, request, deadline, report, booking)
        if failure is None:
            return
        failures.append(failure)
        summary = "; ".join(f.text for f in failures)
        raise unavailable(f"no encoder could encode the request's images ({summary})")

    async def _try(
        self,
        address: str,
        request: encoder_pb2.EncodeRequest,
        deadline: float,
        report: EncodeReport,
        booking: Booking,
    ) -> Failure | None:
        """One Encode call; None on success, the failure when another place may still succeed.
        Bad media and non-retryable statuses raise: no other encoder would do better."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Failure(f"{address}: deadline")
        request.deadline_s = remaining
        self._sending(booking, address)
        try:
            reply = await encoder_pb2_grpc.EncoderStub(self._channel(address)).Encode(request, timeout=remaining)
            note_encoder(address)
            report.add(reply.stages)
            return None
        except grpc.aio.AioRpcError as exc:
            self.release(booking, address)  # not admitted there (a retry is not counted again)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(exc.details()) from exc
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                retry_ms, kind = overload.read(exc.trailing_metadata())
                return Failure(f"{address}: busy", retry_ms, kind, exc.details() or "busy")
            if exc.code() not in RETRYABLE:
                raise RequestError(exc.code(), f"encoder {address}: {exc.details()}") from exc
            return Failure(f"{address}: {exc.code().name}")


def _refuse_when_all_past(past_ms: list[int]) -> None:
    """Refuse (RESOURCE_EXHAUSTED, retry after the least excess, at least 20 ms) when every encoder's expected wait
    is past its budget (each entry: by how many ms, 0 when within)."""
    if all(p > 0 for p in past_ms):
        raise Rejection(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "every encoder is busy (its queue's expected wait is past its budget); retry later",
            "encoders_busy",
            max(20, min(past_ms)),
        )
