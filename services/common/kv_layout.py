"""A worker's KV layout identity: what must be equal for one worker's KV blocks to be written into another's pool.

Prefill/decode disaggregation ships KV blocks between workers as the attention backend lays them out (the wire
layout is the pool's own, never repacked), so a prefill worker and a decode worker pair only when every field
here is equal: the same weights (model revision), dtype, layer count, KV heads, head dim, block size, pool layout
and tensor-parallel size. Each worker publishes its identity in the registry; the router compares them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

WORKER_ROLES = ("both", "prefill", "decode")
"""``both``: prefills and decodes its own requests (a worker before disaggregation); ``prefill``: prefills requests
for decode workers and ships their KV; ``decode``: decodes requests prefilled elsewhere, and prefills short ones."""


@dataclass(frozen=True)
class KVLayout:
    """Everything a KV block's bytes depend on; two workers exchange blocks only when these are equal."""

    model_revision: str
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    layout: str
    tensor_parallel_size: int = 1

    def as_state(self) -> dict[str, Any]:
        """The registry's form (JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> KVLayout | None:
        """Read back ``as_state``; None for a worker that publishes none (or an unreadable one)."""
        if not state:
            return None
        try:
            return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)})
        except (KeyError, TypeError):
            return None

    def pairs_with(self, other: KVLayout | None) -> bool:
        """True when blocks exported by one can be written into the other's pool as they are."""
        return other is not None and self == other
