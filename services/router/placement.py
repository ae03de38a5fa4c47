"""Ranking workers for a request: the prefill a worker's prefix cache saves against the load it already carries.

A worker's cost for a request is `affinity_weight x (prompt tokens it would compute) + (tokens of KV reserved
there)`, lowest first, ties by queue (NVIDIA Dynamo's KV router weighs overlap against active blocks the same
way). Both terms are in tokens, so workers with different KV block sizes compare fairly: a worker of block
size `s` computes `prompt_tokens - s x (leading blocks of the prompt it holds)` and carries
`s x reserved_blocks`; counting blocks instead would make a 256-token block weigh as much as a 16-token one.
With one block size the cost is `s` x the per-block cost plus a constant, so the ranking is the same.
Strict affinity first would pile every request sharing a chat template's first block onto one worker
while another idles; with this cost a cached prefix wins when it saves more prefill than the extra load
costs. Affinity is soft state: each router remembers which worker it sent recent prompt prefixes to
(block hashes from services/common/block_hash.py, the same the workers compute, at that worker's block
size; hashes of different sizes never coincide, so a prefix recorded at one size matches only workers
of that size). Losing it costs cache hits, never correctness, so router replicas need not share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.cluster_view import WorkerView
from services.router.request_blocks import RequestBlocks


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


def prefill_tokens(request: RequestBlocks, worker: WorkerView, affinity: PrefixAffinity) -> int:
    """Prompt tokens `worker` would compute: all but the leading blocks (at its block size) last sent there."""
    size = worker.block_size
    return request.prompt_tokens - size * affinity.matched_blocks(request.hashes(size), worker.address)


def rank_workers(
    workers: Sequence[WorkerView], request: RequestBlocks, affinity: PrefixAffinity, affinity_weight: float = 1.0
) -> list[WorkerView]:
    """Workers with room for the request now (its need at their block size), least cost first."""
    fitting = [w for w in workers if w.unreserved_blocks >= request.need_on(w)]

    def cost(worker: WorkerView) -> tuple[float, int]:
        load = worker.reserved_blocks * worker.block_size
        return (affinity_weight * prefill_tokens(request, worker, affinity) + load, worker.waiting)

    return sorted(fitting, key=cost)
