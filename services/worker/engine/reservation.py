"""Reserve accounting: the blocks promised to admitted requests."""

from __future__ import annotations

import math
from collections.abc import Hashable

from services.common.kv_blocks import blocks_for
from services.worker.engine.block_manager import BlockManager


class NeverFits(ValueError):
    """A request needs more blocks than this worker could ever reserve for one request (the worker answers
    FAILED_PRECONDITION: no retry here helps, another worker may hold it)."""


class ReservationLedger:
    """Blocks each admitted sequence (one per choice of a request, keyed by its ``seq_id``) may hold at most,
    checked against the worker's total.

    Invariant: ``reserved_blocks`` (blocks in use plus the blocks admitted requests may still take,
    i.e. ``used + sum(need) - sum(ref counts)``) never exceeds ``limit`` = total x overcommit because
    of a ``reserve``; allocation and finishing only lower it. With overcommit 1.0 every admitted
    request can therefore always get its next block, and preemption never happens. A cached block
    shared with a running request is counted once, so a request reusing it costs less. Every sequence
    holds at most its ``need`` blocks: a later choice of a request reserves its blocks less the prompt
    blocks it will share, and its need grows by those (``take_shared``) as it takes them.
    """

    def __init__(self, block_manager: BlockManager, overcommit: float = 1.0) -> None:
        self.block_manager = block_manager
        self.limit = math.floor(block_manager.num_blocks * overcommit)
        self.need: dict[Hashable, int] = {}
        self.total_need = 0

    def __contains__(self, key: object) -> bool:
        return key in self.need

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_manager.block_size)

    @property
    def reserved_blocks(self) -> int:
        bm = self.block_manager
        return bm.num_used_blocks + self.total_need - bm.num_refs

    def check_fits(self, request_id: str, num_blocks: int, num_tokens: int) -> None:
        """The one capacity check: raise NeverFits when ``num_blocks`` (a whole request's, ``num_tokens``
        projected) is more than ``limit``, what one request could ever reserve here."""
        if num_blocks > self.limit:
            raise NeverFits(
                f"request {request_id!r} needs {num_blocks} KV blocks ({num_tokens} tokens); this worker holds "
                f"at most {self.limit}"
            )

    def can_reserve(self, num_blocks: int) -> bool:
        return self.reserved_blocks + num_blocks <= self.limit

    def reserve(self, key: Hashable, num_blocks: int) -> bool:
        """Promise ``num_blocks`` to ``key`` (a sequence's ``seq_id``; replacing an earlier promise) if they fit."""
        return self.reserve_many({key: num_blocks})

    def reserve_many(self, needs: dict[Hashable, int]) -> bool:
        """Promise ``needs[key]`` blocks to each key (replacing their earlier promises), all or nothing: the
        choices of one request, which must fit together."""
        previous = sum(self.need.get(key, 0) for key in needs)
        if self.reserved_blocks - previous + sum(needs.values()) > self.limit:
            return False
        self.total_need += sum(needs.values()) - previous
        self.need.update(needs)
        return True

    def take_shared(self, key: Hashable, num_blocks: int, num_in_use: int) -> bool:
        """Grow ``key``'s promise by ``num_blocks``, the shared prompt blocks its reservation left out, as
        it takes a prefix hit of which ``num_in_use`` blocks other sequences hold.

        Taking the hit adds a reference to each hit block, and a block in use costs no free block, so
        ``reserved_blocks`` grows by ``num_blocks - num_in_use``: nothing in the usual case (choice 0 still
        holds its prompt blocks), some when they were freed meanwhile. Refused (nothing changes; the caller
        waits) when that growth would pass the limit.
        """
        if self.reserved_blocks + num_blocks - num_in_use > self.limit:
            return False
        self.need[key] += num_blocks
        self.total_need += num_blocks
        return True

    def release(self, key: Hashable) -> None:
        """Drop the promise (call after the sequence's blocks are deallocated)."""
        self.total_need -= self.need.pop(key, 0)
