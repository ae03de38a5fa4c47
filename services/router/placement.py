"""Ranking workers for a request: the prefill a worker's prefix cache saves against the load it already carries.

A worker's cost for a request is `affinity_weight x (prompt blocks it would compute) + (blocks reserved there)`,
lowest first, ties by queue (NVIDIA Dynamo's KV router weighs overlap against active blocks the same way).
Strict affinity first would pile every request sharing a chat template's first block onto one worker
while another idles; with this cost a cached prefix wins when it saves more prefill than the extra load
costs. Affinity is soft state: each router remembers which worker it sent recent prompt prefixes to
(block hashes from services/common/block_hash.py, the same the workers compute). Losing it
costs cache hits, never correctness, so router replicas need not share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.cluster_view import WorkerView


class PrefixAffinity:
    """An LRU of block hash -> worker address, bounded to `max_entries`."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._max_entries = max_entries

    def matched_blocks(self, hashes: Sequence[bytes], worker: str) -> int:
        """How many leading blocks of `hashes` were last sent to `worker`."""
        count = 0
        for block in hashes:
            if self._owner.get(block) != worker:
                break
            count += 1
        return count

    def record(self, hashes: Sequence[bytes], worker: str) -> None:
        for block in hashes:
            self._owner[block] = worker
            self._owner.move_to_end(block)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)


def rank_workers(workers: Sequence[WorkerView], needed_blocks: int, hashes: Sequence[bytes],
                 affinity: PrefixAffinity, affinity_weight: float = 1.0) -> list[WorkerView]:
    """Workers that could take `needed_blocks` now, least cost first (`hashes`: the prompt's full blocks)."""
    fitting = [w for w in workers if w.unreserved_blocks >= needed_blocks]

    def cost(worker: WorkerView) -> tuple[float, int]:
        to_compute = len(hashes) - affinity.matched_blocks(hashes, worker.address)
        return (affinity_weight * to_compute + worker.reserved_blocks, worker.waiting)

    return sorted(fitting, key=cost)
