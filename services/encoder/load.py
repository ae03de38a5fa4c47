"""Admission and load accounting for one encoder: admit by expected wait, bounded by counts.

`Admission.admit` runs on the event loop with no I/O and no await, so a refusal costs microseconds.
It admits a request while the expected wait for its items stays within the time budget: the items
already admitted plus its own, at the drain rate measured on the items encoded before
(`EncoderRates`). An ordinary
burst is queued and served; only a backlog longer than the budget is refused (`Overloaded` with
kind `WAIT`: the caller should refuse its client). The counts (preprocessing slots, queued tokens)
stay as hard ceilings for memory; a refusal by a ceiling is kind `FULL`, momentary by construction,
which a router may hold and retry, unless the expected wait is past the budget as well (then `WAIT`).
The returned `Ticket` gives each slot and token back.

Invariants:
- `queued_items` / `queued_tokens` count exactly the admitted items not yet finished (encoded,
  failed, or found already encoded by the cache or another encoder); `Ticket.finish` is
  idempotent per item, so every path may call it.
- A request is admitted whenever nothing is queued, whatever its size or the budget (a lone
  request never starves); otherwise it is refused when its expected wait passes the budget, when
  its items do not fit in the pool's queue, or when its tokens would pass the token cap.
- A request a router `booked` (it checked this encoder's time budget from the published load and
  counted the items on it before placing the request on a worker) is not judged by the time budget
  again, only by the ceilings and its deadline: the drain rate moves by several times within a
  burst as tower batches complete, and a second judgement by a newer rate would refuse requests
  that already hold a worker's blocks, slowly. With several routers the budget can be passed by
  what the others booked within one heartbeat.
- An item waiting for another encoder's embedding (`Ticket.waiting_for_peer`) stays queued but is not this
  encoder's work: while only such items are here the encoder is idle for the drain rate. A peer that died holding
  the lock keeps its waiters up to the lock's TTL; counted as busy, such a wait (30 s of an unrenewed TTL) became
  one sample of a few tokens that priced every token at seconds and refused all requests while it stayed.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from services.common.overload import FULL, WAIT
from services.encoder.batcher import Batcher
from services.encoder.preprocess_pool import PoolReservation, PreprocessPool, QueueFull

_EWMA = 0.2


class Overloaded(RuntimeError):
    """RESOURCE_EXHAUSTED: retry after `retry_after_ms`; `kind` is `WAIT` or `FULL` (module docstring)."""

    def __init__(self, message: str, retry_after_ms: int, kind: str = WAIT) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.kind = kind


class EncoderRates:
    """How fast the encoder drains its queue: busy seconds per encoder token over its last `span_s` busy seconds.

    Each encoded item's sample is the busy time since the previous completion (or since the encoder
    became busy, when it was idle) and the item's tokens: completions of a busy encoder come one
    throughput-interval apart, however many items run side by side and whatever shares the host's cores,
    and idle time never counts. The rate is the window's busy seconds over its tokens (an item's cost grows
    with its tokens: a 200x200 image costs a fraction of a 448x448 one and a video many), the window the
    newest samples that cover `span_s` (never fewer than one): a tower call that finishes a batch of many
    items at once gives one long sample and many of zero, and the window holds the long one while it holds
    any of the zeros. While busy, the time since the last completion counts as a sample of the tokens that
    will end together next (the tower call's batch, or one item of the window's mean) when that raises the
    rate: when completions stall (the host slowed), the rate rises at once, not at the next completion.
    Cache hits, failures and videos add no sample. The prior, `prior` items of `item_tokens` at `item_s` each (the
    warm-up's measured item), is the first sample, so a burst's first completions (the first carries the
    pipeline's fill) move it in proportion.
    """

    def __init__(self, item_s: float = 0.05, item_tokens: int = 256, span_s: float = 2.0, prior: int = 8) -> None:
        self._samples: deque[tuple[float, int, int]] = deque([(prior * item_s, prior * item_tokens, prior)])
        self._seconds = prior * item_s
        self._tokens = prior * item_tokens
        self._items = prior
        self._span_s = span_s
        self._busy_from: float | None = None

    def token_s(self, now: float, completing: int = 0) -> float:
        """Seconds per encoder token at the measured throughput, as of `now`, with `completing` tokens to finish
        together next (a tower call's batch; 0: one item of the window's mean)."""
        measured = self._seconds / self._tokens
        if self._busy_from is None:
            return measured
        completing = completing or max(1, round(self._tokens / self._items))
        return max(measured, (self._seconds + now - self._busy_from) / (self._tokens + completing))

    def started(self, now: float, in_encoder_before: int) -> None:
        """Items were admitted at `now`; `in_encoder_before` items were in the encoder already."""
        if in_encoder_before == 0:
            self._busy_from = now

    def paused(self, now: float, in_encoder_after: int) -> None:
        """An item stopped being the encoder's work at `now` (it waits for another encoder), leaving
        `in_encoder_after` items working: with none, the busy time ends without a sample."""
        if in_encoder_after == 0:
            self._busy_from = None

    def finished(self, now: float, in_encoder_after: int, tokens: int, encoded: bool, sample: bool = True) -> None:
        """An item of `tokens` left the encoder at `now` (`encoded`: through the tower), leaving
        `in_encoder_after` items. An encoded item that is not a `sample` (a video: its frames' decode costs
        many times an image's per token, 15.7 s for 96 tokens of a 2 s clip on a loaded host, and the rate
        prices images) ends its busy time without adding to the rate."""
        if encoded and self._busy_from is not None:
            if sample:
                self._add(max(0.0, now - self._busy_from), max(1, tokens))
            self._busy_from = now
        if in_encoder_after == 0:
            self._busy_from = None

    def drain_s(self, tokens: int, now: float, completing: int = 0) -> float:
        """Seconds to get `tokens` encoder tokens through the encoder, as of `now` (`completing`: see `token_s`)."""
        return tokens * self.token_s(now, completing)

    def _add(self, seconds: float, tokens: int) -> None:
        self._samples.append((seconds, tokens, 1))
        self._seconds += seconds
        self._tokens += tokens
        self._items += 1
        while len(self._samples) > 1 and self._seconds - self._samples[0][0] >= self._span_s:
            old_seconds, old_tokens, old_items = self._samples.popleft()
            self._seconds -= old_seconds
            self._tokens -= old_tokens
            self._items -= old_items


@dataclass(frozen=True)
class EncoderLoad:
    """A snapshot of the encoder's queues (published by the heartbeat, read by the router)."""

    queued_items: int
    queued_tokens: int
    preprocess_outstanding: int
    batch_queue_items: int
    batch_queue_tokens: int
    expected_wait_ms: int
    over_budget_ms: int  # how far the expected wait is past the budget: the router refuses before any call
    token_ms: float = 0.0  # the measured drain rate, milliseconds per encoder token (`EncoderRates.token_s`)
    budget_ms: int = 0  # the longest expected wait admitted (`max_queue_s`)

    def as_state(self) -> dict[str, float]:
        return asdict(self)


class Ticket:
    """One admitted request's slots and tokens; owned by the event loop thread."""

    def __init__(self, admission: Admission, reservation: PoolReservation, tokens: list[int]) -> None:
        self._admission = admission
        self.reservation = reservation
        self._tokens = list(tokens)
        self._open = [True] * len(tokens)
        self._slot_unused = [True] * len(tokens)

    def use_slot(self, index: int) -> PoolReservation:
        """Mark item `index`'s slot as spent on a decode job (the pool releases it when done)."""
        self._slot_unused[index] = False
        return self.reservation

    @contextlib.contextmanager
    def waiting_for_peer(self) -> Iterator[None]:
        """One of the items waits for the embedding another encoder is producing: queued still, but not this
        encoder's work while the block runs (see the module's invariants)."""
        self._admission._pause()
        try:
            yield
        finally:
            self._admission._resume()

    def finish(self, index: int, encoded: bool = False, sample: bool = True) -> None:
        """Item `index` is done (any outcome; `encoded` when it ran through the tower, which measures the
        drain rate unless not a `sample`: see `EncoderRates.finished`): give back its tokens, and its slot if
        unused."""
        if not self._open[index]:
            return
        self._open[index] = False
        if self._slot_unused[index]:
            self._slot_unused[index] = False
            self.reservation.release(1)
        self._admission._finish(self._tokens[index], encoded, sample)


class Admission:
    """See the module docstring. `max_queue_s` is the longest expected wait admitted."""

    def __init__(
        self, pool: PreprocessPool, batcher: Batcher, token_cap: int, max_queue_s: float, rates: EncoderRates
    ) -> None:
        self._pool = pool
        self._batcher = batcher
        self._token_cap = token_cap
        self._max_queue_s = max_queue_s
        self.rates = rates
        self._items = 0
        self._tokens = 0
        self._waiting = 0  # of the items, those waiting for another encoder's embedding

    def admit(self, tokens: list[int], budget_s: float | None = None, booked: bool = False) -> Ticket:
        """Reserve for items costing `tokens` each, expected to finish within `budget_s` (the request's deadline)
        and, unless `booked` (a router checked the encoder's time budget for them already and counted them on its
        queue), within the encoder's `max_queue_s`; raises Overloaded at once when they do not fit."""
        wanted = sum(tokens)
        now = time.monotonic()
        if self._items:
            budget = math.inf if budget_s is None else budget_s
            if not booked:
                budget = min(budget, self._max_queue_s)
            wait = self.expected_wait_s(wanted, now)
            if wait > budget:
                raise Overloaded(
                    f"encoder queue too long: expected wait {wait:.2f}s for {self._items} queued item(s) "
                    f"({self._tokens} tokens) and this request's {len(tokens)} ({wanted}), budget {budget:.2f}s",
                    self._retry_ms(wait - budget),
                    WAIT,
                )
            if self._tokens + wanted > self._token_cap:
                raise Overloaded(
                    f"encoder queue is full: {self._tokens} encoder tokens queued, the request adds "
                    f"{wanted}, cap {self._token_cap}",
                    self._retry_ms(self._drain_s(self._tokens + wanted - self._token_cap, now)),
                    self._ceiling_kind(wanted, now),
                )
        try:
            reservation = self._pool.reserve(len(tokens))
        except QueueFull as exc:
            retry = self._retry_ms(self._drain_s(wanted, now))
            raise Overloaded(
                f"{exc}; the request needs {len(tokens)}", retry, self._ceiling_kind(wanted, now)
            ) from None
        self.rates.started(now, self._items - self._waiting)
        self._items += len(tokens)
        self._tokens += wanted
        return Ticket(self, reservation, tokens)

    def _ceiling_kind(self, tokens: int, now: float) -> str:
        """A ceiling's refusal: `FULL` (momentary, a router may hold the request for a slot), but `WAIT` when the
        expected wait with `tokens` more is past the time budget too, as it is for a request a router booked by a
        rate the burst has since slowed: held, it was refused 2 s later (`encoder_full_after_wait`), never served."""
        return WAIT if self._items and self.expected_wait_s(tokens, now) > self._max_queue_s else FULL

    def expected_wait_s(self, tokens: int = 0, now: float | None = None) -> float:
        """Seconds until the admitted items, plus `tokens` more encoder tokens, are through the encoder (as of
        `now`)."""
        return self._drain_s(self._tokens + tokens, time.monotonic() if now is None else now)

    def _drain_s(self, tokens: int, now: float) -> float:
        return self.rates.drain_s(tokens, now, self._batcher.running_tokens)

    @staticmethod
    def _retry_ms(seconds: float) -> int:
        return min(10_000, max(20, round(1000 * seconds)))

    def snapshot(self) -> EncoderLoad:
        now = time.monotonic()
        wait_s = self.expected_wait_s(0, now)
        return EncoderLoad(
            self._items,
            self._tokens,
            self._pool.outstanding,
            self._batcher.queued_items,
            self._batcher.queued_tokens,
            round(1000 * wait_s),
            round(1000 * max(0.0, wait_s - self._max_queue_s)),
            round(1000 * self.rates.token_s(now, self._batcher.running_tokens), 6),
            round(1000 * self._max_queue_s),
        )

    def _finish(self, tokens: int, encoded: bool, sample: bool) -> None:
        self._items -= 1
        self._tokens -= tokens
        self.rates.finished(time.monotonic(), self._items - self._waiting, tokens, encoded, sample)

    def _pause(self) -> None:
        self._waiting += 1
        self.rates.paused(time.monotonic(), self._items - self._waiting)

    def _resume(self) -> None:
        self.rates.started(time.monotonic(), self._items - self._waiting)
        self._waiting -= 1
