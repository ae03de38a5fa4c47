"""A request's KV footprint per worker block size: the blocks it needs and its prompt's prefix block hashes.

Workers may differ in KV block size (256 tokens with the flash backend, 16 on CPUs, or EPD_BLOCK_SIZE),
and both a request's block count and its block hashes depend on it. The block count is the workers' own
formula (services/common/kv_blocks.py), n choices sharing the prompt's full blocks. Invariants: a worker of block size
`s` is always judged with `need(s)` and `hashes(s)`, never another size's; the hashes of a size are
computed at most once per request, and only when asked for, so a cluster of one size hashes each prompt
once, as before, and a request refused before ranking hashes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.block_hash import extend_block_hashes
from services.common.kv_blocks import request_blocks
from services.models.media_span import MediaSpan
from services.router.cluster_view import WorkerView


class RequestBlocks:
    """`prompt_tokens` (what `hasher` covers), `projected_tokens` (prompt + n x max_tokens), `n` choices, and
    `hasher(block_size)`: the prompt's full-block hashes at that size."""

    def __init__(
        self, prompt_tokens: int, projected_tokens: int, hasher: Callable[[int], Sequence[bytes]], n: int = 1
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.projected_tokens = projected_tokens
        self.n = max(n, 1)
        self.max_tokens = (projected_tokens - prompt_tokens) // self.n
        self._hasher = hasher
        self._hashes: dict[int, Sequence[bytes]] = {}

    @classmethod
    def for_prompt(
        cls,
        token_ids: Sequence[int],
        projected_tokens: int,
        media: Sequence[MediaSpan] = (),
        cache_salt: str = "",
        n: int = 1,
    ) -> RequestBlocks:
        """The footprint of a prompt, hashed as the workers hash it (services/common/block_hash.py)."""
        return cls(
            len(token_ids),
            projected_tokens,
            lambda size: extend_block_hashes([], token_ids, size, media, cache_salt),
            n,
        )

    def need(self, block_size: int, enable_prefix_caching: bool = True) -> int:
        """Blocks of `block_size` tokens the request reserves: ceil(projected_tokens / block_size) for one choice;
        for n, choice 0's blocks plus each other's, less the prompt's shared full blocks when the worker caches
        prefixes (`request_blocks`, the worker's own formula)."""
        return request_blocks(self.prompt_tokens, self.max_tokens, self.n, block_size, enable_prefix_caching)

    def need_on(self, worker: WorkerView) -> int:
        """The blocks `worker` will reserve for the request, at its block size and prefix-caching setting."""
        return self.need(worker.block_size, worker.enable_prefix_caching)

    def hashes(self, block_size: int) -> Sequence[bytes]:
        """The prompt's full-block hashes at `block_size` (computed on first use, then kept)."""
        if block_size not in self._hashes:
            self._hashes[block_size] = self._hasher(block_size)
        return self._hashes[block_size]
