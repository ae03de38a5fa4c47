"""Reserve accounting: the blocks promised to admitted requests."""

from __future__ import annotations

import math

from services.worker.engine.block_manager import BlockManager


class ReservationLedger:
    """Blocks each admitted request may hold at most, checked against the worker's total.

    Invariant: ``reserved_blocks`` (blocks in use plus the blocks admitted requests may still take,
    i.e. ``used + sum(need) - sum(ref counts)``) never exceeds ``limit`` = total x overcommit because
    of a ``reserve``; allocation and finishing only lower it. With overcommit 1.0 every admitted
    request can therefore always get its next block, and preemption never happens. A cached block
    shared with a running request is counted once, so a request reusing it costs less.
    """

    def __init__(self, block_manager: BlockManager, overcommit: float = 1.0) -> None:
        self.block_manager = block_manager
        self.limit = math.floor(block_manager.num_blocks * overcommit)
        self.need: dict[str, int] = {}
        self.total_need = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.need

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_manager.block_size)

    @property
    def reserved_blocks(self) -> int:
        bm = self.block_manager
        return bm.num_used_blocks + self.total_need - bm.num_refs

    def can_reserve(self, num_blocks: int) -> bool:
        return self.reserved_blocks + num_blocks <= self.limit

    def reserve(self, request_id: str, num_blocks: int) -> bool:
        """Promise ``num_blocks`` to ``request_id`` (replacing an earlier promise) if they fit."""
        previous = self.need.get(request_id, 0)
        if self.reserved_blocks - previous + num_blocks > self.limit:
            return False
        self.need[request_id] = num_blocks
        self.total_need += num_blocks - previous
        return True

    def release(self, request_id: str) -> None:
        """Drop the promise (call after the request's blocks are deallocated)."""
        self.total_need -= self.need.pop(request_id, 0)
