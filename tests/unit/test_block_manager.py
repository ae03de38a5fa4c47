"""Block manager properties: random allocate / compute / append / free / abort never leak or double free,
ref counts match the block tables, and a prefix-cache hit (its copied prompt tail included) always serves the right
tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.sequence import Sequence

BLOCK = 4


def make_seq(request_id: str, tokens: list[int], max_tokens: int = 8, salt: str = "") -> Sequence:
    request = EngineRequest(request_id, tokens, sampling=SamplingOptions(max_tokens=max_tokens), cache_salt=salt)
    return Sequence(request, BLOCK, hash_blocks=True)


def request_id(seq: Sequence) -> str:
    return seq.request_id


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager like the scheduler does, with a fake KV store: slot -> token id."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK, enable_prefix_caching=True)
        self.kv: dict[int, int] = {}
        self.live: dict[str, Sequence] = {}
        self.counter = 0

    @rule(
        prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]),
        tail=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from(["", "", "other"]),
    )
    def add(self, prefix: list[int], tail: list[int], salt: str) -> None:
        self.counter += 1
        self.live[f"r{self.counter}"] = make_seq(f"r{self.counter}", prefix + tail, salt=salt)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=request_id)))
        hit = self.bm.find_prefix(seq, tail=True) if not seq.block_table else None
        start = hit.num_tokens if hit else seq.num_computed_tokens
        num = min(chunk, seq.num_tokens - start)
        if num <= 0 or not self.bm.can_allocate(seq, start + num, hit):
            return
        self.bm.allocate(seq, start + num, hit)
        if hit:
            if hit.tail_block is not None:  # the engine copies the whole block before the step
                source, destination = hit.tail_block, seq.block_table[len(hit.block_ids)]
                copied = {i: self.kv.get(source * BLOCK + i) for i in range(BLOCK)}
                for i, token in copied.items():
                    self.kv[destination * BLOCK + i] = token
            seq.num_computed_tokens = hit.num_tokens
            self._check_content(seq)  # the hit blocks (and copied tail) hold exactly this sequence's tokens
        for i in range(start, start + num):  # the "model" writes K/V of each computed token
            self.kv[seq.block_table[i // BLOCK] * BLOCK + i % BLOCK] = seq.token_ids[i]
        seq.num_computed_tokens = start + num
        self.bm.cache_full_blocks(seq)
        if start < seq.num_prompt_tokens <= seq.num_computed_tokens:  # as the scheduler's update
            self.bm.cache_prompt_tail(seq)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.live.values()))
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data: st.DataObject, token: int) -> None:
        done = sorted((s for s in self.live.values() if s.num_computed_tokens == s.num_tokens), key=request_id)
        data.draw(st.sampled_from(done)).append_token(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Finish or abort at any point: prefilling, decoding or not started."""
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live.pop(request_id)
        self.bm.deallocate(seq)
        self.bm.deallocate(seq)  # a second free of the same sequence is a no-op, never a double free

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.bm.deallocate(seq)
        seq.reset_for_recompute()

    def _check_content(self, seq: Sequence) -> None:
        for i in range(seq.num_computed_tokens):
            assert self.kv[seq.block_table[i // BLOCK] * BLOCK + i % BLOCK] == seq.token_ids[i]

    @invariant()
    def ref_counts_match_tables(self) -> None:
        holders: dict[int, int] = {}
        for seq in self.live.values():
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block_id in seq.block_table:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.bm.free_block_ids)
        assert self.bm.num_refs == sum(holders.values())
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks

    @invariant()
    def cached_blocks_are_consistent(self) -> None:
        for block_hash, block_id in self.bm.hash_to_block.items():
            block = self.bm.blocks[block_id]
            assert block.block_hash == block_hash and len(block.token_ids) == BLOCK
            assert [self.kv[block_id * BLOCK + i] for i in range(BLOCK)] == block.token_ids

    @invariant()
    def published_tails_hold_their_tokens(self) -> None:
        for key, block_id in self.bm.tail_to_block.items():
            tokens = key[1]
            assert self.bm.blocks[block_id].tail_key == key
            assert [self.kv.get(block_id * BLOCK + i) for i in range(len(tokens))] == list(tokens)

    @invariant()
    def computed_tokens_are_in_place(self) -> None:
        for seq in self.live.values():
            self._check_content(seq)

    def teardown(self) -> None:
        for seq in self.live.values():
            self.bm.deallocate(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.num_refs == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_prefix_hit_keeps_one_token_to_compute() -> None:
    bm = BlockManager(8, BLOCK)
    first = make_seq("a", list(range(8)))
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.cache_full_blocks(first)
    same = make_seq("b", list(range(8)))
    assert bm.find_prefix(same).num_tokens == 4  # the last block is recomputed for its logits
    longer = make_seq("c", list(range(9)))
    hit = bm.find_prefix(longer)
    assert hit.num_tokens == 8 and hit.block_ids == first.block_table
    bm.allocate(longer, 9, hit)
    assert bm.blocks[first.block_table[0]].ref_count == 2 and bm.num_used_blocks == 3


def test_freed_cached_blocks_are_reused_then_evicted_oldest_first() -> None:
    bm = BlockManager(4, BLOCK)
    a = make_seq("a", list(range(9)))
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    again = make_seq("a2", list(range(9)))
    assert bm.find_prefix(again).num_tokens == 8  # still cached after the free
    bm.allocate(make_seq("x", [50] * 8), 8)  # the never-used block, then the freed partial tail
    assert bm.find_prefix(again).num_tokens == 8
    bm.allocate(make_seq("y", [60] * 4), 4)  # then the newest-freed full block: the end of the prefix
    assert bm.find_prefix(again).num_tokens == 4


def test_an_exact_repeat_takes_the_prompts_last_block_and_computes_one_token() -> None:
    bm = BlockManager(8, BLOCK)
    first = make_seq("a", list(range(7)))  # a full block and three tokens
    bm.allocate(first, 7)
    first.num_computed_tokens = 7
    bm.cache_full_blocks(first)
    bm.cache_prompt_tail(first)
    again = make_seq("b", list(range(7)))
    assert bm.find_prefix(again).num_tokens == 4  # without tails: block-granular
    hit = bm.find_prefix(again, tail=True)
    assert (hit.num_tokens, hit.block_ids, hit.tail_block) == (6, first.block_table[:1], first.block_table[1])
    other_end = make_seq("c", [0, 1, 2, 3, 4, 5, 9])
    assert bm.find_prefix(other_end, tail=True).tail_block is None
    salted = make_seq("d", list(range(3)), salt="tenant-2")  # block 0's tail carries the salt
    plain = make_seq("e", list(range(3)))
    bm.allocate(plain, 3)
    plain.num_computed_tokens = 3
    bm.cache_prompt_tail(plain)
    assert bm.find_prefix(make_seq("f", list(range(3))), tail=True).tail_block == plain.block_table[0]
    assert bm.find_prefix(salted, tail=True).tail_block is None
    source = first.block_table[1]
    bm.deallocate(first)
    bm.allocate(again, 7, hit)
    assert again.block_table[1] != source  # a block of its own, the tail's slots copied into it
    assert bm.blocks[source].ref_count == 0  # the source stays free, still published
    assert bm.find_prefix(make_seq("g", list(range(7))), tail=True).tail_block == source
    while bm.num_free_blocks:  # taking the freed source for new tokens unpublishes it
        bm.allocate(make_seq(f"x{bm.num_free_blocks}", [50] * 4), 4)
    assert bm.find_prefix(make_seq("h", list(range(7))), tail=True).tail_block is None


def test_token_check_guards_hash_collisions() -> None:
    bm = BlockManager(4, BLOCK)
    a = make_seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    b = make_seq("b", [9, 9, 9, 9, 5])
    b.block_hashes[0] = a.block_hashes[0]  # forge a collision
    assert bm.find_prefix(b).num_tokens == 0


def test_double_free_of_a_block_is_detected() -> None:
    bm = BlockManager(2, BLOCK)
    a = make_seq("a", [1, 2])
    bm.allocate(a, 2)
    table = list(a.block_table)
    bm.deallocate(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.deallocate(a)
