"""Admission and load accounting for one encoder.

`Admission.admit` runs on the event loop with no I/O and no await, so a refusal costs microseconds:
it reserves one preprocessing slot per item that may need decoding (all or none) and counts the
items' encoder tokens against the cap. The returned `Ticket` gives each slot and token back.

Invariants:
- `queued_items` / `queued_tokens` count exactly the admitted items not yet finished (encoded,
  failed, or found already encoded by the cache or another encoder); `Ticket.finish` is
  idempotent per item, so every path may call it.
- A request is refused when its items do not fit in the pool's queue, or when tokens are already
  queued and its own would pass the cap (a lone request above the cap still runs, never starves).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from services.encoder.batcher import Batcher
from services.encoder.preprocess_pool import PoolReservation, PreprocessPool, QueueFull

_EWMA = 0.2


class Overloaded(RuntimeError):
    """RESOURCE_EXHAUSTED: retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class EncoderLoad:
    """A snapshot of the encoder's queues (published by the heartbeat, read by the router)."""

    queued_items: int
    queued_tokens: int
    preprocess_outstanding: int
    batch_queue_items: int
    batch_queue_tokens: int

    def as_state(self) -> dict[str, int]:
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

    def finish(self, index: int) -> None:
        """Item `index` is done (any outcome): give back its tokens, and its slot if unused."""
        if not self._open[index]:
            return
        self._open[index] = False
        if self._slot_unused[index]:
            self._slot_unused[index] = False
            self.reservation.release(1)
        self._admission._finish(self._tokens[index])


class Admission:
    """See the module docstring."""

    def __init__(self, pool: PreprocessPool, batcher: Batcher, token_cap: int) -> None:
        self._pool = pool
        self._batcher = batcher
        self._token_cap = token_cap
        self._items = 0
        self._tokens = 0
        self._item_seconds = 0.05

    def admit(self, tokens: list[int]) -> Ticket:
        """Reserve for items costing `tokens` each; raises Overloaded at once when they do not fit."""
        wanted = sum(tokens)
        if self._tokens and self._tokens + wanted > self._token_cap:
            raise Overloaded(
                f"encoder queue is full: {self._tokens} encoder tokens queued, the request adds "
                f"{wanted}, cap {self._token_cap}",
                self.retry_after_ms(),
            )
        try:
            reservation = self._pool.reserve(len(tokens))
        except QueueFull as exc:
            raise Overloaded(f"{exc}; the request needs {len(tokens)}", self.retry_after_ms()) from None
        self._items += len(tokens)
        self._tokens += wanted
        return Ticket(self, reservation, tokens)

    def observe_item_seconds(self, seconds: float) -> None:
        """Feed one item's admission-to-embedding time into the retry-after estimate."""
        self._item_seconds += _EWMA * (seconds - self._item_seconds)

    def retry_after_ms(self) -> int:
        """About how long until the queue has drained enough for a retry to get in."""
        per_worker = math.ceil(max(1, self._items) / self._pool.workers)
        return int(min(10_000, max(20, 1000 * self._item_seconds * per_worker)))

    def snapshot(self) -> EncoderLoad:
        return EncoderLoad(
            self._items, self._tokens, self._pool.outstanding, self._batcher.queued_items, self._batcher.queued_tokens
        )

    def _finish(self, tokens: int) -> None:
        self._items -= 1
        self._tokens -= tokens
