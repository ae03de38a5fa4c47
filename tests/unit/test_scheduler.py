"""Scheduler: one token budget, running first, chunked prefill, embedding gating, reservations, n choices,
decode priority (free slots, latency target)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.kv_blocks import request_blocks, shared_prompt_blocks
from services.models.media_span import MediaSpan
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.itl_target import ItlTarget
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.scheduler import Scheduler, SchedulerOutput
from services.worker.engine.sequence import Sequence, request_choices
from services.worker.engine.step_cost import StepCostModel, StepShape

BLOCK = 4


def make_scheduler(num_blocks: int = 64, embeddings: set[str] | None = None, **overrides: object) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, **{"max_num_batched_tokens": 16, "max_num_seqs": 8, **overrides})
    bm = BlockManager(num_blocks, BLOCK, config.enable_prefix_caching)
    return Scheduler(config, bm, embeddings if embeddings is not None else set())


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 4, media: list[MediaSpan] | None = None) -> Sequence:
    request = EngineRequest(request_id, prompt, media or [], SamplingOptions(max_tokens=max_tokens))
    return Sequence(request, BLOCK, hash_blocks=True)


def fake_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends on the whole token list (and the choice) only."""
    return (sum(seq.token_ids) * 31 + len(seq.token_ids) + 7 * seq.index) % 50 + 10


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, mark computed, sample, finish."""
    out = sched.schedule()
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    for chunk in out.chunks:  # every scheduled token has a slot
        assert len(chunk.seq.block_table) * BLOCK >= chunk.start + chunk.num_tokens
    sched.update(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.seq.append_token(fake_token(chunk.seq))
            reason = chunk.seq.stop_reason(frozenset())
            if reason:
                sched.finish(chunk.seq, reason)
    return out


def run_all(sched: Scheduler, max_steps: int = 2000) -> int:
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def test_chunked_prefill_then_decode() -> None:
    sched = make_scheduler()
    seq = make_seq("a", list(range(40)), max_tokens=3)
    sched.add(seq)
    sizes = [[c.num_tokens for c in step(sched).chunks] for _ in range(5)]
    assert sizes == [[16], [16], [8], [1], [1]]
    assert seq.is_finished and len(seq.output_token_ids) == 3


def test_running_first_then_waiting_under_one_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_seq("a", list(range(6)), max_tokens=8), make_seq("b", list(range(30)), max_tokens=2)
    sched.add(a)
    step(sched)  # a prefilled
    sched.add(b)
    out = step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    out = step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]


def test_media_waits_for_its_embedding_text_before_goes_ahead() -> None:
    ready: set[str] = set()
    sched = make_scheduler(embeddings=ready, max_num_batched_tokens=64)
    seq = make_seq("a", [1] * 10 + [99] * 8 + [2] * 5, max_tokens=2, media=[MediaSpan("img", 10, 8, (1, 4, 8))])
    sched.add(seq)
    assert [c.num_tokens for c in step(sched).chunks] == [10]
    assert step(sched).chunks == [] and seq.missing_embeddings(ready) == ["img"]
    ready.add("img")
    assert [c.num_tokens for c in step(sched).chunks] == [13]
    assert seq.missing_embeddings(ready) == []


def test_request_starting_with_media_does_not_block_others() -> None:
    sched = make_scheduler()
    blocked = make_seq("img", [99] * 8 + [1], media=[MediaSpan("x", 0, 8)])
    sched.add(blocked)
    sched.add(make_seq("text", [1, 2, 3]))
    out = step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["text"] and list(sched.waiting) == [blocked]


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(make_seq(f"r{i}", [i] * 5))
    step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_prefix_cache_hit_sets_cached_tokens_and_same_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    first = make_seq("a", list(range(21)), max_tokens=5)
    sched.add(first)
    run_all(sched)
    second = make_seq("b", list(range(21)), max_tokens=5)
    sched.add(second)
    out = step(sched)
    assert second.num_cached_tokens == 20 and out.chunks[0].num_tokens == 1
    run_all(sched)
    assert second.output_token_ids == first.output_token_ids


def test_reservation_accounting() -> None:
    sched = make_scheduler(num_blocks=10)
    ledger = sched.ledger
    assert ledger.reserve("x", 6) and ledger.reserved_blocks == 6
    assert not ledger.can_reserve(5) and ledger.can_reserve(4)
    assert not ledger.reserve("y", 5)
    ledger.release("x")
    assert ledger.reserved_blocks == 0


def test_sharing_a_running_prefix_costs_less() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=64)
    a = make_seq("a", list(range(17)), max_tokens=3)  # 20 tokens: 5 blocks
    sched.add(a)
    step(sched)
    assert sched.ledger.reserved_blocks == 5
    sched.add(make_seq("b", list(range(17)), max_tokens=3))
    step(sched)
    assert sched.ledger.reserved_blocks == 6  # b shares a's 4 full prompt blocks: 5 + 5 - 4


def test_unreserved_request_waits_for_room() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a, b = make_seq("a", list(range(12)), max_tokens=8), make_seq("b", list(range(50, 62)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert list(sched.waiting) == [b] and b.seq_id not in sched.ledger
    run_all(sched)
    assert a.is_finished and b.is_finished and sched.num_preemptions == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=12),
    budget=st.integers(1, 48),
    num_blocks=st.integers(14, 40),  # the longest request (41 + 12 tokens) fits alone
    caching=st.booleans(),
)
def test_overcommit_one_never_preempts_and_frees_everything(
    prompts: list[tuple[int, int, int]], budget: int, num_blocks: int, caching: bool
) -> None:
    sched = make_scheduler(num_blocks, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    for i, (length, max_tokens, family) in enumerate(prompts):
        sched.add(make_seq(f"r{i}", [family] * length + [i], max_tokens))
    run_all(sched)
    bm = sched.block_manager
    assert sched.num_preemptions == 0
    assert bm.num_free_blocks == bm.num_blocks and sched.ledger.reserved_blocks == 0


def make_choices(request_id: str, prompt: list[int], max_tokens: int, n: int, caching: bool) -> list[Sequence]:
    request = EngineRequest(request_id, prompt, [], SamplingOptions(max_tokens=max_tokens, n=n))
    return request_choices(request, BLOCK, hash_blocks=caching)


def test_later_choices_wait_for_the_prompt_blocks_and_share_them() -> None:
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=8)
    choices = make_choices("a", list(range(17)), max_tokens=3, n=3, caching=True)  # 5 blocks each, 4 shared
    assert [s.seq_id for s in choices] == [("a", 0), ("a", 1), ("a", 2)] and [s.name for s in choices][1] == "a/1"
    assert [s.reserve_blocks for s in choices] == [5, 1, 1]
    assert sched.ledger.reserve_many({s.seq_id: s.reserve_blocks for s in choices})
    for seq in choices:
        sched.add(seq)
    assert sched.ledger.reserved_blocks == 7 == request_blocks(17, 3, 3, BLOCK)
    step(sched)  # 8 of 17 prompt tokens: 2 of the 4 shared blocks
    assert sched.running == [choices[0]] and all(s.waits_for_prompt() for s in choices[1:])
    step(sched)
    out = step(sched)  # choice 0 samples; both later choices take its 4 blocks and compute the last token
    assert [(c.seq.name, c.start, c.num_tokens) for c in out.chunks] == [("a", 16, 1), ("a/1", 16, 1), ("a/2", 16, 1)]
    assert choices[1].block_table[:4] == choices[0].block_table[:4] == choices[2].block_table[:4]
    assert choices[1].num_cached_tokens == 16 and sched.ledger.reserved_blocks == 7  # the need grew with the refs
    run_all(sched)
    assert sched.block_manager.num_free_blocks == 40 and sched.ledger.reserved_blocks == 0 and not sched.ledger.need
    assert len({tuple(s.output_token_ids) for s in choices}) == 3


def test_later_choice_whose_shared_blocks_were_freed_grows_its_reservation() -> None:
    """Choice 0 finishes (one token) before the others start: its prompt blocks are free, cached; the others
    take them as a hit that costs free blocks, so their reservation grows by that much, within the limit."""
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=32, max_num_seqs=1)
    choices = make_choices("a", list(range(13)), max_tokens=1, n=2, caching=True)  # 4 blocks each, 3 shared
    assert sched.ledger.reserve_many({s.seq_id: s.reserve_blocks for s in choices})
    for seq in choices:
        sched.add(seq)
    step(sched)
    assert choices[0].is_finished and sched.ledger.reserved_blocks == 1  # the later choice's 4 - 3
    assert sched.ledger.reserve("other", 9)  # 1 + 9 = 10: taking 3 freed blocks would make 13 > 12
    step(sched)
    assert choices[1].status.name == "WAITING" and sched.ledger.reserved_blocks == 10
    sched.ledger.release("other")
    run_all(sched)
    assert choices[1].num_cached_tokens == 12 and choices[1].is_finished and sched.num_preemptions == 0
    assert sched.block_manager.num_free_blocks == 12 and sched.ledger.reserved_blocks == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 30),
            st.sampled_from([1, 1, 2, 5, 8]),  # max_tokens: often one, so choice 0 ends before the others start
            st.integers(1, 4),
            st.integers(0, 2),
            st.booleans(),
            st.integers(0, 6),
        ),
        min_size=1,
        max_size=10,
    ),
    budget=st.integers(1, 48),
    num_blocks=st.integers(12, 24),  # tight: later choices often find the limit nearly reached
    seqs=st.sampled_from([1, 1, 2, 8]),  # often one: later choices wait while choice 0 runs to its end
    caching=st.booleans(),
)
def test_n_choices_never_pass_the_limit_nor_preempt_and_free_everything(
    requests: list[tuple[int, int, int, int, bool, int]], budget: int, num_blocks: int, seqs: int, caching: bool
) -> None:
    """Requests of 1-4 choices arriving over a few steps, some reserved whole at arrival (as ``Engine.admit``),
    the others reserving as they start; choice 0 often done (one token) before the others start: at every step
    ``reserved_blocks`` stays within the limit, no sequence holds more blocks than its reservation, nothing is
    preempted at overcommit 1.0, and everything returns at the end."""
    sched = make_scheduler(num_blocks, max_num_batched_tokens=budget, max_num_seqs=seqs, enable_prefix_caching=caching)
    ledger, bm = sched.ledger, sched.block_manager
    arrivals: dict[int, list[tuple[list[Sequence], bool]]] = {}
    for i, (length, max_tokens, n, family, reserve_first, at) in enumerate(requests):
        prompt = [family] * length + [i]
        if request_blocks(len(prompt), max_tokens, n, BLOCK, caching) > ledger.limit:
            continue  # the engine refuses it at add_request: it could never fit
        choices = make_choices(f"r{i}", prompt, max_tokens, n, caching)
        shared = shared_prompt_blocks(len(prompt), BLOCK) if caching else 0
        first = choices[0].max_num_blocks
        assert [s.reserve_blocks for s in choices] == [first] + [first - shared] * (n - 1)
        arrivals.setdefault(at, []).append((choices, reserve_first))
    for now in range(3000):
        for choices, reserve_first in arrivals.pop(now, []):
            if reserve_first:  # may refuse: then each choice reserves as it starts
                ledger.reserve_many({s.seq_id: s.reserve_blocks for s in choices})
            for seq in choices:
                sched.add(seq)
        if not sched.has_work() and not arrivals:
            break
        step(sched)
        assert ledger.reserved_blocks <= ledger.limit and sched.num_preemptions == 0
        for seq in sched.running:
            assert len(seq.block_table) <= ledger.need[seq.seq_id]
    assert not sched.has_work(), "no progress"
    assert bm.num_free_blocks == bm.num_blocks and ledger.reserved_blocks == 0 and not ledger.need


def test_overcommit_preempts_by_recompute_with_same_result() -> None:
    prompts = [(f"r{i}", [i % 3] * (10 + i), 12) for i in range(6)]
    results = []
    for overcommit, blocks in ((1.0, 60), (3.0, 12)):
        sched = make_scheduler(blocks, max_num_batched_tokens=32, overcommit=overcommit)
        seqs = [make_seq(rid, prompt, max_tokens) for rid, prompt, max_tokens in prompts]
        for seq in seqs:
            sched.add(seq)
        run_all(sched)
        results.append([s.output_token_ids for s in seqs])
        assert sched.block_manager.num_free_blocks == blocks
        assert (sched.num_preemptions > 0) == (overcommit > 1)
    assert results[0] == results[1]


def test_decode_priority_caps_prefill_by_free_slots() -> None:
    """With ``prefill_tokens_per_free_seq``, prefill tokens per step shrink as more sequences decode, never
    below one block; decodes are not capped, and every sequence ends with the tokens of an uncapped run."""
    capped = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4, prefill_tokens_per_free_seq=2)
    plain = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    seqs: dict[int, list[Sequence]] = {}
    for key, sched in ((0, capped), (1, plain)):
        seqs[key] = [make_seq(f"r{i}", list(range(1 + i, 30 + 3 * i)), max_tokens=6) for i in range(6)]
        for seq in seqs[key]:
            sched.add(seq)
    steps = 0
    while capped.has_work():
        decoding = [s for s in capped.running if s.num_tokens - s.num_computed_tokens == 1]
        out = step(capped)
        prefill = sum(c.num_tokens for c in out.chunks if c.seq not in decoding)
        assert prefill <= max(BLOCK, 2 * (4 - len(decoding)))
        assert all(any(c.seq is s for c in out.chunks) for s in decoding)  # every decode ran
        steps += 1
        assert steps < 500
    run_all(plain)
    assert [s.token_ids for s in seqs[0]] == [s.token_ids for s in seqs[1]]
    assert all(s.finish_reason == "length" for s in seqs[0])


# A step-cost model with no measured step predicts with its prior: 1 ms a step, 0.1 ms a decode row, 0.1 ms a
# prefill token, next to nothing for context; steps are planned at least 15 % under the target (ItlTarget's
# headroom), so a 3.5 ms target plans 3.04 ms and leaves (3.04 - 1 - 0.1 x rows) / 0.1 prefill tokens, 18 next to two
# decodes.
TARGET_PRIOR = (1e-3, 1e-4, 1e-12, 1e-4, 1e-15)


def make_targeted(target_ms: float, **overrides: object) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, **{"max_num_batched_tokens": 64, "max_num_seqs": 8, **overrides})
    bm = BlockManager(64, BLOCK, config.enable_prefix_caching)
    target = ItlTarget(target_ms / 1000, StepCostModel(prior=TARGET_PRIOR), minimum=BLOCK)
    return Scheduler(config, bm, set(), target)


def decoding(sched: Scheduler) -> list[Sequence]:
    return [s for s in sched.running if s.num_tokens - s.num_computed_tokens == 1]


def test_itl_target_sizes_prefill_next_to_decodes() -> None:
    sched = make_targeted(3.5)
    a, b = make_seq("a", list(range(10)), max_tokens=20), make_seq("b", list(range(5, 17)), max_tokens=20)
    sched.add(a)
    sched.add(b)
    first = step(sched)  # nobody decodes yet: the whole budget, no target consulted
    assert [c.num_tokens for c in first.chunks] == [10, 12] and first.itl_budget is None
    assert step(sched).itl_budget is None  # decodes and no prefill waiting: nothing to size
    long = make_seq("long", list(range(100, 160)), max_tokens=2)
    sched.add(long)
    out = step(sched)
    assert out.itl_budget == 18  # (3.5 / 1.15 - 1 - 2 x 0.1) ms / 0.1 ms, rounded down
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("long", 18)]
    out = step(sched)
    assert out.itl_budget == 18 and out.chunks[-1].num_tokens == 18
    assert sched.itl_target.model.predict(StepShape.of(out.chunks)) <= sched.itl_target.planned_s()


def test_itl_target_keeps_a_minimum_chunk_and_everything_ends() -> None:
    """A target no step can meet still lets prefill advance a block per step; outputs equal an untargeted run."""
    tight, plain = make_targeted(0.01), make_scheduler(max_num_batched_tokens=64)
    seqs = {}
    for key, sched in (("tight", tight), ("plain", plain)):
        seqs[key] = [make_seq(f"r{i}", list(range(1 + i, 30 + 5 * i)), max_tokens=8) for i in range(5)]
        sched.add(seqs[key][0])
        step(sched)  # r0 alone: whole budget
        for seq in seqs[key][1:]:
            sched.add(seq)
    steps = 0
    while tight.has_work():
        decodes = decoding(tight)
        pending = bool(tight.waiting) or len(decodes) < len(tight.running)
        out = step(tight)
        prefill = sum(c.num_tokens for c in out.chunks if c.seq not in decodes)
        if decodes and pending:  # a block's worth next to the decodes, never nothing
            assert out.itl_budget == BLOCK and 0 < prefill <= BLOCK
        steps += 1
        assert steps < 500
    run_all(plain)
    assert [s.token_ids for s in seqs["tight"]] == [s.token_ids for s in seqs["plain"]]
    assert tight.block_manager.num_free_blocks == 64 and tight.ledger.reserved_blocks == 0


def test_itl_target_and_free_slot_rule_take_the_smaller_cap() -> None:
    sched = make_targeted(3.5, max_num_seqs=4, prefill_tokens_per_free_seq=2)  # 2 x (4 - 2) = 4 < 18
    loose = make_targeted(30.0, max_num_seqs=4, prefill_tokens_per_free_seq=16)  # 16 x 2 = 32 < 278
    for s in (sched, loose):
        s.add(make_seq("a", list(range(10)), max_tokens=20))
        s.add(make_seq("b", list(range(5, 17)), max_tokens=20))
        while len(decoding(s)) < 2:
            step(s)
        s.add(make_seq("long", list(range(100, 160)), max_tokens=2))
    out = step(sched)
    assert out.itl_budget == 18 and out.chunks[-1].num_tokens == BLOCK
    out = step(loose)
    assert out.itl_budget == 64 and out.chunks[-1].num_tokens == 32  # the target allows the whole budget
