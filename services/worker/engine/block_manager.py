"""Paged KV blocks: allocation, reference counts and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.block_hash import ROOT_HASH, ExtraKey, block_extra_keys
from services.worker.engine.sequence import Sequence

TailKey = tuple[bytes, tuple[int, ...], tuple[ExtraKey, ...], str]
"""A prompt's last (partial) block: the hash of the full blocks before it, its tokens, the media keys overlapping it
and the cache salt when it is block 0 (``block_hash``'s fields, kept whole: exact within one engine)."""


@dataclass
class Block:
    """One block of ``block_size`` KV slots; ``block_hash`` is set once it is full and computed."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)
    tail_key: TailKey | None = None  # set while its first slots hold a computed prompt's last block (see below)


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks matching the start of a sequence, in order; with ``tail_block``, the block whose first slots
    hold the tokens after them up to ``num_tokens`` (copied into the sequence's own block before the step runs)."""

    block_ids: list[int]
    num_tokens: int
    tail_block: int | None = None


class BlockManager:
    """Hands out KV blocks to sequences and keeps full blocks reusable by their chained hash.

    Invariant: every block is either used (``ref_count`` > 0, equal to the number of sequence block
    tables holding it) or free (``ref_count`` == 0, listed once in ``free_block_ids`` in the order it was
    freed); ``num_refs`` is the sum of all ref counts. ``hash_to_block`` maps a hash to a block that
    carries that hash and whose ``token_ids`` are that block's tokens; a free block with a hash is a
    cached block, reusable until it is the oldest free block and gets taken for new tokens.

    Prompt tails: a computed prompt's last block, partial or full, is published under its `TailKey`
    (``cache_prompt_tail``) in ``tail_to_block``. The block's slots before the prompt's end never change while
    its sequence holds it (its later slots take generated tokens) nor while it lies free; taking it for new
    tokens (eviction) unpublishes it. A sequence whose every full block hits and whose last block's key is
    published copies those slots instead of computing them (``find_prefix(seq, tail=True)``): an exact repeat of
    a prompt computes one token, not the up to 16 of its last block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.tail_to_block: dict[TailKey, int] = {}
        self.num_refs = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    def find_prefix(self, seq: Sequence, tail: bool = False) -> PrefixHit:
        """Longest run of cached blocks equal to the sequence's first blocks, keeping one token to compute; with
        ``tail``, past a hit on every full block, the published last block of the same tokens as well."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        last = (seq.num_tokens - 1) // self.block_size  # the block of the token left to compute
        max_blocks = min(last, len(seq.block_hashes))
        block_ids = []
        for index in range(max_blocks):
            block_id = self.hash_to_block.get(seq.block_hashes[index])
            if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(index):
                break
            block_ids.append(block_id)
        if tail and len(block_ids) == last and seq.num_tokens - 1 > last * self.block_size:
            tail_block = self.tail_to_block.get(self._tail_key(seq, seq.num_tokens))
            if tail_block is not None:
                return PrefixHit(block_ids, seq.num_tokens - 1, tail_block)
        return PrefixHit(block_ids, len(block_ids) * self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks that covering ``num_tokens`` tokens of ``seq`` takes (a cached free hit counts)."""
        covered = len(seq.block_table) + (len(hit.block_ids) if hit else 0)
        fresh = max(-(-num_tokens // self.block_size) - covered, 0)
        revived = sum(1 for b in hit.block_ids if self.blocks[b].ref_count == 0) if hit else 0
        return fresh + revived

    def can_allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        return self.num_new_blocks(seq, num_tokens, hit) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> None:
        """Give ``seq`` the hit blocks (first allocation only), then fresh blocks for ``num_tokens`` slots."""
        if hit and hit.block_ids:
            if seq.block_table:
                raise RuntimeError(f"prefix hit for {seq.name} which already holds blocks")
            for block_id in hit.block_ids:
                self._take(block_id)
                seq.block_table.append(block_id)
            seq.num_registered_blocks = len(hit.block_ids)
        while len(seq.block_table) * self.block_size < num_tokens:
            if not self.free_block_ids:
                raise RuntimeError(f"out of KV blocks for {seq.name}")
            block_id = next(iter(self.free_block_ids))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's references, last block first so its tail is evicted before its prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id} by {seq.name}")
            block.ref_count -= 1
            self.num_refs -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of the blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for index in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            block.block_hash = seq.block_hashes[index]
            block.token_ids = seq.block_tokens(index)
            self.hash_to_block[block.block_hash] = block.block_id
        seq.num_registered_blocks = max(num_full, seq.num_registered_blocks)

    def cache_prompt_tail(self, seq: Sequence) -> None:
        """Publish the last block of ``seq``'s prompt, whose tokens are all computed now."""
        if not self.enable_prefix_caching or seq.num_computed_tokens < seq.num_prompt_tokens:
            return
        index = (seq.num_prompt_tokens - 1) // self.block_size
        block = self.blocks[seq.block_table[index]]
        block.tail_key = self._tail_key(seq, seq.num_prompt_tokens)
        self.tail_to_block[block.tail_key] = block.block_id

    def _tail_key(self, seq: Sequence, end: int) -> TailKey:
        """The `TailKey` of tokens ``[start of the block of token end - 1, end)`` of ``seq``."""
        index = (end - 1) // self.block_size
        start = index * self.block_size
        parent = seq.block_hashes[index - 1] if index else ROOT_HASH
        keys = tuple(block_extra_keys(start, end, seq.media)) if seq.media else ()
        return parent, tuple(seq.token_ids[start:end]), keys, seq.cache_salt if index == 0 else ""

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1
        self.num_refs += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = []
        if block.tail_key is not None:
            if self.tail_to_block.get(block.tail_key) == block_id:
                del self.tail_to_block[block.tail_key]
            block.tail_key = None
