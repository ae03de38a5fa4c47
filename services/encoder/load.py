"""Admission and load accounting for one encoder: admit by expected wait, bounded by counts.

`Admission.admit` runs on the event loop with no I/O and no await, so a refusal costs microseconds.
It admits a request while the expected wait for its items stays within the time budget: the items
already admitted plus its own, at the drain rate measured on the items encoded before
(`EncoderRates`). An ordinary
burst is queued and served; only a backlog longer than the budget is refused (`Overloaded` with
kind `WAIT`: the caller should refuse its client). The counts (preprocessing slots, queued tokens)
stay as hard ceilings for memory; a refusal by a ceiling is kind `FULL`, momentary by construction,
which a router may hold and retry. The returned `Ticket` gives each slot and token back.

Invariants:
- `queued_items` / `queued_tokens` count exactly the admitted items not yet finished (encoded,
  failed, or found already encoded by the cache or another encoder); `Ticket.finish` is
  idempotent per item, so every path may call it.
- A request is admitted whenever nothing is queued, whatever its size or the budget (a lone
  request never starves); otherwise it is refused when its expected wait passes the budget, when
  its items do not fit in the pool's queue, or when its tokens would pass the token cap.
"""

from __future__ import annotations

import time
from collections import deque
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
    """How fast the encoder drains its queue: busy seconds per encoded item over the last `window` items.

    Each encoded item's sample is the busy time since the previous completion (or since the encoder
    became busy, when it was idle): completions of a busy encoder come one throughput-interval apart,
    however many items run side by side and whatever shares the host's cores, and idle time never
    counts. Cache hits and failures add no sample. `prior` samples of `item_s` seed the window, so
    the first few measurements (the first of a burst carries the whole burst's wait) move it only
    in proportion.
    """

    def __init__(self, item_s: float = 0.05, window: int = 32, prior: int = 8) -> None:
        self._samples: deque[float] = deque([item_s] * prior, maxlen=window)
        self._busy_from: float | None = None

    @property
    def item_s(self) -> float:
        """Seconds per item at the measured throughput."""
        return sum(self._samples) / len(self._samples)

    def started(self, now: float, in_encoder_before: int) -> None:
        """Items were admitted at `now`; `in_encoder_before` items were in the encoder already."""
        if in_encoder_before == 0:
            self._busy_from = now

    def finished(self, now: float, in_encoder_after: int, encoded: bool) -> None:
        """An item left the encoder at `now` (`encoded`: through the tower), leaving `in_encoder_after`."""
        if encoded and self._busy_from is not None:
            self._samples.append(max(0.0, now - self._busy_from))
            self._busy_from = now
        if in_encoder_after == 0:
            self._busy_from = None

    def drain_s(self, items: int) -> float:
        """Seconds to get `items` items through the encoder."""
        return items * self.item_s


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
    item_ms: float = 0.0  # the measured drain rate, milliseconds per item (`EncoderRates.item_s`)
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

    def finish(self, index: int, encoded: bool = False) -> None:
        """Item `index` is done (any outcome; `encoded` when it ran through the tower, which measures the
        drain rate): give back its tokens, and its slot if unused."""
        if not self._open[index]:
            return
        self._open[index] = False
        if self._slot_unused[index]:
            self._slot_unused[index] = False
            self.reservation.release(1)
        self._admission._finish(self._tokens[index], encoded)


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

    def admit(self, tokens: list[int], budget_s: float | None = None) -> Ticket:
        """Reserve for items costing `tokens` each, expected to finish within `budget_s` (the encoder's
        `max_queue_s` when None or larger); raises Overloaded at once when they do not fit."""
        wanted = sum(tokens)
        if self._items:
            budget = min(self._max_queue_s, budget_s if budget_s is not None else self._max_queue_s)
            wait = self.expected_wait_s(len(tokens))
            if wait > budget:
                raise Overloaded(
                    f"encoder queue too long: expected wait {wait:.2f}s for {self._items} queued item(s) "
                    f"and this request's {len(tokens)}, budget {budget:.2f}s",
                    self._retry_ms(wait - budget),
                    WAIT,
                )
            if self._tokens + wanted > self._token_cap:
                raise Overloaded(
                    f"encoder queue is full: {self._tokens} encoder tokens queued, the request adds "
                    f"{wanted}, cap {self._token_cap}",
                    self._retry_ms(self.rates.drain_s(1)),
                    FULL,
                )
        try:
            reservation = self._pool.reserve(len(tokens))
        except QueueFull as exc:
            retry = self._retry_ms(self.rates.drain_s(len(tokens)))
            raise Overloaded(f"{exc}; the request needs {len(tokens)}", retry, FULL) from None
        self.rates.started(time.monotonic(), self._items)
        self._items += len(tokens)
        self._tokens += wanted
        return Ticket(self, reservation, tokens)

    def expected_wait_s(self, items: int = 0) -> float:
        """Seconds until the admitted items, plus `items` more, are through the encoder."""
        return self.rates.drain_s(self._items + items)

    @staticmethod
    def _retry_ms(seconds: float) -> int:
        return min(10_000, max(20, round(1000 * seconds)))

    def snapshot(self) -> EncoderLoad:
        return EncoderLoad(
            self._items,
            self._tokens,
            self._pool.outstanding,
            self._batcher.queued_items,
            self._batcher.queued_tokens,
            round(1000 * self.expected_wait_s()),
            round(1000 * max(0.0, self.expected_wait_s() - self._max_queue_s)),
            round(1000 * self.rates.item_s, 3),
            round(1000 * self._max_queue_s),
        )

    def _finish(self, tokens: int, encoded: bool) -> None:
        self._items -= 1
        self._tokens -= tokens
        self.rates.finished(time.monotonic(), self._items, encoded)
