"""Continuous batching under one token budget per step (no prefill or decode phase)."""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from services.worker.engine.block_manager import BlockManager, PrefixHit
from services.worker.engine.config import EngineConfig
from services.worker.engine.itl_target import ItlTarget
from services.worker.engine.reservation import ReservationLedger
from services.worker.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of ``seq`` computed this step; ``samples`` when that reaches
    the sequence's last token, so a new token is sampled after it.

    Read-only by convention, not frozen: a frozen dataclass's ``__init__`` costs ~1 us more, for every row of
    every step.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool


def _chunk(seq: Sequence, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(seq, start, num_tokens, start + num_tokens == len(seq.token_ids))


@dataclass
class SchedulerOutput:
    """One step's chunks, the sequences preempted for it, the prefill budget the latency target chose (None when
    none was consulted: no target, no decode running, or no prefill waiting), and the ``(source, destination)``
    blocks to copy before the step runs (prompt tails taken from the cache, block_manager.py)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    itl_budget: int | None = None
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Picks, each step, which tokens of which sequences the model computes.

    Invariant: every live sequence is in exactly one of ``waiting`` (no blocks held) or ``running``
    (blocks covering its computed tokens); every sequence in ``running`` holds a reservation in the
    ledger; ``len(running) <= max_num_seqs``. Each step, running sequences catch up first, in order,
    then waiting ones are admitted, all under ``max_num_batched_tokens``; a media item's tokens are
    scheduled only once its embedding is in ``embeddings``, text before it may go ahead. Prefill tokens
    (of sequences lacking more than one token) also stay under ``_prefill_budget`` (decode priority: the
    smaller of ``prefill_tokens_per_free_seq``'s cap and ``itl_target``'s, each at least one block).
    A later choice of a request starts only once choice 0's full prompt blocks are cached (or choice 0
    ended), and takes them as a prefix hit. ``ready`` holds sequences whose prompt KV another engine computed
    (kv_connector.py: blocks and reservation held, status ``RECEIVING``): they join ``running`` first, as decodes.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        embeddings: Container[str],
        itl_target: ItlTarget | None = None,
    ) -> None:
        self.config = config
        self.itl_target = itl_target
        self.block_manager = block_manager
        self.ledger = ReservationLedger(block_manager, config.overcommit)
        self.embeddings = embeddings
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ready: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues and give back its blocks and reservation."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.ready:
            self.ready.remove(seq)
        self.block_manager.deallocate(seq)
        self.ledger.release(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self, spent_s: float = 0.0) -> SchedulerOutput:
        """This step's chunks; ``spent_s``: how long the decoding sequences have waited since their last token
        (an ITL target plans the step to fit in what is left)."""
        out = SchedulerOutput()
        while self.ready and len(self.running) < self.config.max_num_seqs:
            seq = self.ready.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        budget = self.config.max_num_batched_tokens
        prefill = self._prefill_budget(budget, out, spent_s)
        size, chunks = self.block_manager.block_size, out.chunks
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            computed, num_tokens = seq.num_computed_tokens, len(seq.token_ids)
            if (
                num_tokens - computed == 1
                and (seq.grammar is None or seq.grammar.ready)
                and (computed >= seq.num_prompt_tokens or not seq.media)
            ):
                # a plain decode (the common row; a generated token is never media, a started grammar never
                # waits): nothing can block its one token, and its last block mostly has room; what
                # _num_new_tokens, _make_room and allocate would find, without the calls
                if len(seq.block_table) * size <= computed:
                    if not self._make_room(seq, num_tokens, out):
                        continue
                    self.block_manager.allocate(seq, num_tokens)
                chunks.append(ScheduledChunk(seq, computed, 1, True))
                budget -= 1
                continue
            num_new = self._num_new_tokens(seq, computed, budget, prefill)
            if num_new == 0 or not self._make_room(seq, computed + num_new, out):
                continue
            self.block_manager.allocate(seq, computed + num_new)
            chunks.append(_chunk(seq, computed, num_new))
            budget -= num_new
            if num_tokens - computed > 1:
                prefill -= num_new
        if not out.preempted:
            self._admit_waiting(budget, prefill, out)
        return out

    def _prefill_budget(self, budget: int, out: SchedulerOutput, spent_s: float = 0.0) -> int:
        """Prefill tokens this step may take: all of ``budget``, or less by decode priority. With
        ``prefill_tokens_per_free_seq`` set, that many per sequence slot not decoding this step (at least one
        block's worth); with an ``itl_target`` and decodes running, at most what the target allows (recorded in
        ``out.itl_budget``). The smaller of the two wins."""
        per_slot, target = self.config.prefill_tokens_per_free_seq, self.itl_target
        if per_slot == 0 and target is None:
            return budget
        decodes = prefill_context = decode_context = 0
        prefilling = bool(self.waiting)
        for seq in self.running:
            num_tokens = len(seq.token_ids)
            lacking = num_tokens - seq.num_computed_tokens
            if lacking == 1:
                decodes += 1
                decode_context += num_tokens
            elif lacking > 1:
                prefilling = True
                prefill_context = max(prefill_context, seq.num_computed_tokens)
        prefill = budget
        if per_slot:
            free_slots = max(self.config.max_num_seqs - decodes, 0)
            prefill = max(self.block_manager.block_size, per_slot * free_slots)
        if target is not None and decodes and prefilling:
            out.itl_budget = target.prefill_budget(decodes, decode_context, prefill_context, budget, spent_s)
            prefill = min(prefill, out.itl_budget)
        return prefill

    def update(self, out: SchedulerOutput) -> None:
        """After the model ran: the scheduled tokens are computed; publish newly full blocks and the last block of
        a prompt computed to its end."""
        size = self.block_manager.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if seq.num_computed_tokens // size > seq.num_registered_blocks:
                self.block_manager.cache_full_blocks(seq)
            if chunk.start < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self.block_manager.cache_prompt_tail(seq)

    def _admit_waiting(self, budget: int, prefill: int, out: SchedulerOutput) -> None:
        admit_unreserved = True
        for seq in list(self.waiting):
            if budget == 0 or prefill <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if seq.waits_for_prompt():
                continue  # a later choice: choice 0 computes the prompt blocks it will share
            if seq.seq_id not in self.ledger:
                if not admit_unreserved:
                    continue
                if not self.ledger.reserve(seq.seq_id, seq.reserve_blocks):
                    admit_unreserved = False  # first come first served among unreserved requests
                    continue
            hit = self.block_manager.find_prefix(seq, tail=True)
            num_new = self._num_new_tokens(seq, hit.num_tokens, budget, prefill)
            if num_new == 0:
                continue  # its first uncached tokens wait for an embedding
            num_tokens = hit.num_tokens + num_new
            if not self.block_manager.can_allocate(seq, num_tokens, hit):
                return  # only when overcommitted: wait for running requests to free blocks
            if seq.shared_blocks and not self._take_shared(seq, hit):
                continue  # the shared blocks were freed and the ledger cannot cover them now
            self.block_manager.allocate(seq, num_tokens, hit)
            if hit.tail_block is not None:
                out.block_copies.append((hit.tail_block, seq.block_table[len(hit.block_ids)]))
            seq.num_computed_tokens = hit.num_tokens
            if not seq.prefix_looked_up:
                seq.num_cached_tokens = hit.num_tokens
                seq.prefix_looked_up = True
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            out.chunks.append(_chunk(seq, hit.num_tokens, num_new))
            budget -= num_new
            if seq.num_tokens - hit.num_tokens > 1:
                prefill -= num_new

    def _take_shared(self, seq: Sequence, hit: PrefixHit) -> bool:
        """A later choice starts: its need grows by the shared prompt blocks (``ReservationLedger.take_shared``)."""
        blocks = self.block_manager.blocks
        in_use = sum(1 for block_id in hit.block_ids if blocks[block_id].ref_count > 0)
        if not self.ledger.take_shared(seq.seq_id, seq.shared_blocks, in_use):
            return False
        seq.took_shared_prompt()
        return True

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int, prefill: int) -> int:
        """Tokens to compute from ``num_computed``: under ``budget``, short of a missing embedding, and
        under ``prefill`` unless the sequence lacks only one token (a decode)."""
        limit = seq.first_blocked_offset(num_computed, self.embeddings)
        if seq.num_tokens - num_computed > 1:
            budget = min(budget, prefill)
        return max(min(limit - num_computed, budget), 0)

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the latest running sequences until ``seq`` fits; False if ``seq`` itself went."""
        if len(seq.block_table) * self.block_manager.block_size >= num_tokens:
            return True  # most decode steps: the last block has room
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks, keep the tokens and the reservation."""
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
