"""A request's KV footprint per worker block size: the blocks it needs and its prompt's prefix block hashes.

Workers may differ in KV block size (256 tokens with the flash backend, 16 on CPUs, or EPD_BLOCK_SIZE),
and both a request's block count and its block hashes depend on it. Invariants: a worker of block size
`s` is always judged with `need(s)` and `hashes(s)`, never another size's; the hashes of a size are
computed at most once per request, and only when asked for, so a cluster of one size hashes each prompt
once, as before, and a request refused before ranking hashes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.block_hash import MediaSpan, extend_block_hashes


class RequestBlocks:
    """`prompt_tokens` (what `hasher` covers), `projected_tokens` (prompt + max_tokens), and
    `hasher(block_size)`: the prompt's full-block hashes at that size."""

    def __init__(self, prompt_tokens: int, projected_tokens: int, hasher: Callable[[int], Sequence[bytes]]) -> None:
        self.prompt_tokens = prompt_tokens
        self.projected_tokens = projected_tokens
        self._hasher = hasher
        self._hashes: dict[int, Sequence[bytes]] = {}

    @classmethod
    def for_prompt(
        cls, token_ids: Sequence[int], projected_tokens: int, media: Sequence[MediaSpan] = (), cache_salt: str = ""
    ) -> RequestBlocks:
        """The footprint of a prompt, hashed as the workers hash it (services/common/block_hash.py)."""
        return cls(
            len(token_ids), projected_tokens, lambda size: extend_block_hashes([], token_ids, size, media, cache_salt)
        )

    def need(self, block_size: int) -> int:
        """Blocks of `block_size` tokens the request reserves: ceil(projected_tokens / block_size)."""
        return -(-self.projected_tokens // block_size)

    def hashes(self, block_size: int) -> Sequence[bytes]:
        """The prompt's full-block hashes at `block_size` (computed on first use, then kept)."""
        if block_size not in self._hashes:
            self._hashes[block_size] = self._hasher(block_size)
        return self._hashes[block_size]
