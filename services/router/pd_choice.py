"""The router's per-request choice of a remote prefill: a prefill worker for a long uncached prompt, else local.

Conditional disaggregation as NVIDIA Dynamo decides it: a request is prefilled on a prefill worker only when the
prompt tokens its decode worker would compute (the prompt less the leading blocks that worker's prefix cache
holds, as placement reckons them) reach `EPD_PD_MIN_PREFILL_TOKENS`, and a paired prefill worker
(`ClusterView.prefill_workers_for`: an equal KV layout identity) has fewer than `EPD_PD_MAX_PREFILL_WAITING`
requests waiting and the free blocks for the prompt; otherwise the decode worker prefills it as before. A
short prompt never pays the transfer's time to first token. The decode worker is chosen first, as for any
request (its reservation is the request's admission); the prefill worker admits by its own blocks.
`PrefillPlacement` is the router's placement of that pair: asked for each decode worker admission tries, it
reckons the cached blocks from the router's prefix affinity (the blocks it last sent to that worker) and the
paired prefill workers from the cluster view, and answers the prefill worker or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.kv_blocks import blocks_for
from services.router.cluster_view import ClusterView, WorkerView
from services.router.placement import PrefixAffinity
from services.router.request_blocks import RequestBlocks


@dataclass(frozen=True)
class PrefillPolicy:
    """`EPD_PD_MIN_PREFILL_TOKENS` (0: never remote) and `EPD_PD_MAX_PREFILL_WAITING`."""

    min_prefill_tokens: int = 0
    max_prefill_waiting: int = 8


def uncached_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """The prompt tokens a worker holding ``cached_blocks`` leading blocks of it would compute (at least one: a hit
    always leaves the last token to compute)."""
    return max(prompt_tokens - cached_blocks * block_size, 1)


def choose_prefill(
    policy: PrefillPolicy,
    decode: WorkerView,
    prompt_tokens: int,
    cached_blocks: int,
    candidates: Sequence[WorkerView],
    *,
    transferable: bool = True,
) -> WorkerView | None:
    """The prefill worker for a request placed on ``decode``, or None to prefill there. ``cached_blocks``: the
    prompt's leading blocks ``decode`` holds; ``candidates``: its paired prefill workers; ``transferable``: False
    for what a transfer does not carry (several choices, a structured-output constraint)."""
    if not policy.min_prefill_tokens or not transferable or decode.worker_role != "decode":
        return None
    if uncached_tokens(prompt_tokens, cached_blocks, decode.block_size) < policy.min_prefill_tokens:
        return None
    room = [
        view
        for view in candidates
        if view.waiting < policy.max_prefill_waiting
        and view.unreserved_blocks >= blocks_for(prompt_tokens + 1, view.block_size)
        and decode.kv_layout is not None
        and decode.kv_layout.pairs_with(view.kv_layout)
    ]
    if not room:
        return None
    return min(room, key=lambda view: (view.waiting + view.running, -view.unreserved_blocks, view.address))


class PrefillPlacement:
    """The prefill half of a request's (prefill, decode) pair, for the decode worker admission is trying."""

    def __init__(self, policy: PrefillPolicy, view: ClusterView, affinity: PrefixAffinity) -> None:
        self.policy = policy
        self._view = view
        self._affinity = affinity

    def prefill_for(self, request: RequestBlocks, decode: WorkerView, *, transferable: bool) -> WorkerView | None:
        """The prefill worker to prefill ``request`` for ``decode``, or None: ``decode`` prefills it itself."""
        if not self.policy.min_prefill_tokens or decode.worker_role != "decode":
            return None  # nothing to reckon (and no prompt hashed for it)
        cached = self._affinity.matched_blocks(request.hashes(decode.block_size), decode.address)
        candidates = self._view.prefill_workers_for(decode)
        return choose_prefill(self.policy, decode, request.prompt_tokens, cached, candidates, transferable=transferable)
