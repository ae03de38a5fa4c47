"""The router's picture of the cluster: live workers and encoders from the Redis registry.

Refreshed in the background every `interval_s`. When Redis cannot answer, the last view is
kept (a worker that died meanwhile is found out by its refused connection), so a Redis outage
does not stop placement. Admissions this router made since a worker's last heartbeat are added
to that worker's reserved blocks (and its requests that ended since are subtracted), so neither a
burst nor a heartbeat's lag skews the view (the worker still decides atomically; this only keeps
the router's ranking and its immediate refusals honest); likewise the items it booked on each encoder
since that encoder's last heartbeat are added to its queue, less what the encoder drained since. Draining
workers (services/common/drain.py) are not placed on, but count as present: `absent_for` measures how long
a worker has been missing from both lists while Redis answered, which is how a migration notices a worker
that vanished without a word.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.kv_layout import KVLayout
from services.common.registry import Member, Registry, draining_role

log = logging.getLogger(__name__)
FORGET_AFTER_S = 600.0  # a worker missing this long is forgotten (addresses come and go)
STALE_S = 1.0  # an encoder's heartbeat this old (5 intervals) is taken to have stopped: its backlog drains
UNSENT_TTL_S = 30.0  # a booking whose Encode call never started (nor was taken back) stops counting after this


@dataclass(frozen=True)
class WorkerView:
    address: str
    total_blocks: int
    capacity_blocks: int
    reserved_blocks: int
    running: int
    waiting: int
    block_size: int
    enable_prefix_caching: bool = True  # later choices of a request share choice 0's prompt blocks
    worker_role: str = "both"  # services/common/kv_layout.py WORKER_ROLES
    kv_layout: KVLayout | None = None  # what its KV blocks' bytes depend on (None: a worker publishing none)

    @property
    def unreserved_blocks(self) -> int:
        return max(0, self.capacity_blocks - self.reserved_blocks)


@dataclass(frozen=True)
class EncoderView:
    """An encoder's last published load, and this router's estimate of its queue now (`backlog_tokens`)."""

    address: str
    queued_tokens: int
    over_budget_ms: int = 0  # how far its queue's expected wait was past its budget (0: it admits)
    token_ms: float = 0.0  # its measured drain rate per encoder token (0: an encoder that does not publish one)
    budget_ms: int = 0  # the longest expected wait it admits
    backlog_tokens: float = 0.0  # its queued tokens, plus this router's bookings since (`_Backlog`) and unsent

    def past_budget_ms(self, tokens: float, pending: float = 0.0) -> int:
        """How far past its budget the encoder's expected wait would be with `tokens` more encoder tokens, as the
        encoder itself judges it (services/encoder/load.py: nothing queued admits anything; else every queued
        token and these at its drain rate), from this router's estimate of its queue plus `pending` tokens
        expected to be booked on it; 0 when they would be admitted."""
        if not self.token_ms or not self.budget_ms:
            return self.over_budget_ms  # an encoder publishing no rate: its own verdict
        backlog = self.backlog_tokens + pending
        if backlog <= 0:
            return 0
        return max(0, math.ceil((backlog + tokens) * self.token_ms - self.budget_ms))


@dataclass
class _Backlog:
    """One encoder's queue as this router reckons it: the `tokens` its heartbeat published at `published_at`
    said (read by this router at `read_at`, its clock) plus this router's bookings since. Heartbeats come every
    fraction of a second and replace it, so nothing is drained meanwhile (the encoder's own wait falls only as
    items finish); once none has come for `STALE_S` it drains at the published rate (fail open while blind)."""

    published_at: float
    tokens: float
    read_at: float
    token_ms: float

    def now(self, now: float) -> float:
        drained = 1000 * max(0.0, now - self.read_at - STALE_S) / self.token_ms if self.token_ms else 0.0
        return max(0.0, self.tokens - drained)

    def add(self, tokens: int, now: float) -> None:
        """`tokens` more (negative: fewer) from `now` on; what drained before stays drained."""
        current = self.now(now)
        self.read_at = max(self.read_at, now - STALE_S)
        self.tokens = max(0.0, current + tokens)


@dataclass(eq=False)
class _Pending:
    worker: str
    blocks: int
    at: float


class ClusterView:
    def __init__(
        self, registry: Registry, revision: str, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock  # how long ago this router read each encoder's heartbeat
        self._registry = registry
        self._revision = revision
        self._interval_s = interval_s
        self._workers: list[Member] = []
        self._prefill: list[Member] = []  # prefill workers (registry role "prefill"), never placed on directly
        self._encoders: list[Member] = []
        self._pending: list[_Pending] = []
        self._backlogs: dict[str, _Backlog] = {}  # encoder -> its backlog as this router reckons it
        self._unsent: dict[str, dict[object, tuple[int, float]]] = {}  # encoder -> booking -> (tokens, expiry)
        self._unsent_tokens: dict[str, int] = {}  # encoder -> the sum of its `_unsent` tokens
        self._absent: dict[str, float] = {}  # worker -> seconds missing from answered refreshes, in a row
        self._absence_watches: dict[str, dict[object, tuple[float, Callable[[], None]]]] = {}  # `on_absent`'s
        self._answered_at: float | None = None  # the previous refresh's time, when Redis answered it
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:  # never let the refresher die
                log.exception("cluster view refresh failed")

    async def refresh(self) -> None:
        self._expire_unsent()  # first: Redis answering or not
        roles = ("worker", "encoder", draining_role("worker"), "prefill")
        found = await asyncio.to_thread(self._registry.members_of, roles, self._revision)  # one thread hop
        workers, encoders, draining, prefill = (None,) * 4 if found is None else (found[role] for role in roles)
        self._note_absences(workers, draining)
        if workers is not None:
            self._workers = workers
        if prefill is not None:
            self._prefill = prefill
        if encoders is not None:
            self._encoders = encoders
            now = self._clock()
            known = self._backlogs
            self._backlogs = {}
            for m in encoders:  # a new heartbeat replaces what this router reckoned since the last one
                same = m.address in known and known[m.address].published_at == m.published_at
                queued, token_ms = int(m.state.get("queued_tokens", 0)), float(m.state.get("token_ms", 0.0))
                self._backlogs[m.address] = (
                    known[m.address] if same else _Backlog(m.published_at, queued, now, token_ms)
                )
        # An admission or release stays pending until the worker publishes a state read after it
        # (both times are the worker's own clock, taken from its replies).
        members = [*self._workers, *self._prefill]  # a remote prefill holds its prefill worker's blocks likewise
        seen = {m.address: float(m.state.get("snapshot_at", m.published_at)) for m in members}
        self._pending = [p for p in self._pending if p.at > seen.get(p.worker, math.inf)]
        self.changed.set()
        self.changed = asyncio.Event()

    def hold(self, worker: str, blocks: int) -> _Pending:
        """Count `blocks` as reserved on `worker` while this router asks it (so concurrent requests
        here do not all pick the same worker); then `confirm` it or `drop` it."""
        pending = _Pending(worker, blocks, math.inf)
        self._pending.append(pending)
        return pending

    def confirm(self, pending: _Pending, at: float) -> None:
        """The worker reserved at `at` (its clock); the hold lasts until a snapshot after that."""
        pending.at = at or time.time()

    def drop(self, pending: _Pending) -> None:
        if pending in self._pending:
            self._pending.remove(pending)

    def note_released(self, worker: str, blocks: int, at: float) -> None:
        """A request this router placed has ended; its blocks count as free until a snapshot after `at`
        (the worker's clock when it freed them; 0 when unknown, e.g. a cancelled stream: now is used)."""
        self._pending.append(_Pending(worker, -blocks, at or time.time()))

    def workers(self) -> list[WorkerView]:
        return [self._view(member) for member in self._workers]

    def worker(self, address: str) -> WorkerView | None:
        """The live worker (registry role ``worker``) at ``address``, None when it is not listed."""
        return next((self._view(m) for m in self._workers if m.address == address), None)

    def prefill_workers_for(self, decode: WorkerView) -> list[WorkerView]:
        """The live prefill workers whose KV blocks ``decode`` can take as they are (equal KV layout identities)."""
        if decode.kv_layout is None:
            return []
        views = [self._view(member) for member in self._prefill]
        return [view for view in views if decode.kv_layout.pairs_with(view.kv_layout)]

    def _view(self, member: Member) -> WorkerView:
        state = member.state
        pending = sum(p.blocks for p in self._pending if p.worker == member.address)
        return WorkerView(
            address=member.address,
            total_blocks=int(state["total_blocks"]),
            capacity_blocks=int(state.get("capacity_blocks", state["total_blocks"])),
            reserved_blocks=max(0, int(state["reserved_blocks"]) + pending),
            running=int(state["running"]),
            waiting=int(state["waiting"]),
            block_size=int(state["block_size"]),
            enable_prefix_caching=bool(state.get("enable_prefix_caching", True)),
            worker_role=str(state.get("worker_role", "both")),
            kv_layout=KVLayout.from_state(state.get("kv_layout")),
        )

    def _note_absences(self, workers: list[Member] | None, draining: list[Member] | None) -> None:
        """Count the time each known worker is missing between two answered refreshes (an outage of Redis, or
        a refresh it did not answer, adds nothing: right after Redis restarts nobody is missing yet)."""
        if workers is None or draining is None:
            self._answered_at = None
            return
        now = time.monotonic()
        step = now - self._answered_at if self._answered_at is not None else 0.0
        listed = {m.address for m in [*workers, *draining]}
        self._absent = {a: t + step for a, t in self._absent.items() if a not in listed and t < FORGET_AFTER_S}
        self._absent.update(dict.fromkeys(listed, 0.0))
        self._answered_at = now
        for worker, watches in list(self._absence_watches.items()):
            absent = self._absent.get(worker, 0.0)
            for key in [key for key, (after_s, _) in watches.items() if absent >= after_s]:
                watches.pop(key)[1]()
            if not watches:
                del self._absence_watches[worker]

    def absent_for(self, worker: str) -> float:
        """Seconds `worker` has been missing from the registry (live or draining), counting only time between
        refreshes Redis answered; 0 while it is listed, or when this router never saw it listed."""
        return self._absent.get(worker, 0.0)

    def on_absent(self, worker: str, after_s: float, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` once, at the first refresh after which `absent_for(worker)` reaches ``after_s``;
        returns the function that withdraws it (one watch per caller, checked by the refresh that already runs,
        not a task of its own polling)."""
        key = object()
        self._absence_watches.setdefault(worker, {})[key] = (after_s, callback)

        def withdraw() -> None:
            watches = self._absence_watches.get(worker)
            if watches is not None and watches.pop(key, None) is not None and not watches:
                del self._absence_watches[worker]

        return withdraw

    def note_sent(self, encoder: str, tokens: int) -> None:
        """This router booked items of `tokens` encoder tokens on `encoder` (negative: taken back): added to its
        queue until its next heartbeat (which counts them itself, once admitted), so a burst sees what it adds."""
        backlog = self._backlogs.get(encoder)
        if backlog is not None:
            backlog.add(tokens, self._clock())

    def note_booked(self, encoder: str, booking: object, tokens: int) -> None:
        """This router booked `tokens` on `encoder` for `booking`, whose Encode call has not started (it waits for a
        worker's blocks first): counted on the encoder until `note_unbooked`, whatever its heartbeats say (they count
        only what reached it), or for `UNSENT_TTL_S` at most (a request that ended without either: `refresh` drops
        it)."""
        self.note_unbooked(encoder, booking)
        self._unsent.setdefault(encoder, {})[booking] = (tokens, self._clock() + UNSENT_TTL_S)
        self._unsent_tokens[encoder] = self._unsent_tokens.get(encoder, 0) + tokens

    def note_unbooked(self, encoder: str, booking: object) -> int:
        """`booking`'s tokens on `encoder` stop counting as unsent (its call starts, or it goes no further);
        returns them (0: none were)."""
        tokens, _ = self._unsent.get(encoder, {}).pop(booking, (0, 0.0))
        if tokens:
            self._unsent_tokens[encoder] -= tokens
        return tokens

    def _expire_unsent(self) -> None:
        now = self._clock()
        for encoder, booked in self._unsent.items():
            for booking in [b for b, (_, expiry) in booked.items() if expiry <= now]:
                self.note_unbooked(encoder, booking)

    def encoders(self) -> list[EncoderView]:
        now = self._clock()
        out = []
        for m in self._encoders:
            state = m.state
            backlog = self._backlogs.get(m.address)
            unsent = self._unsent_tokens.get(m.address, 0)
            out.append(
                EncoderView(
                    m.address,
                    int(state.get("queued_tokens", 0)),
                    int(state.get("over_budget_ms", 0)),
                    token_ms=float(state.get("token_ms", 0.0)),
                    budget_ms=int(state.get("budget_ms", 0)),
                    backlog_tokens=(backlog.now(now) if backlog is not None else 0.0) + unsent,
                )
            )
        return out
