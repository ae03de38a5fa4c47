"""The scheduler side of KV transfer: which blocks of which request to ship after a step, and where shipped ones land.

Prefill/decode disaggregation as vLLM v1 splits its KV connector: this piece decides what to send and receive
(block indices, token counts, hashes), `kv_copy.py` copies the bytes. A prefill engine marks a request
``KV_SEND``: after every step that computed some of its prompt, the blocks that step finished (all layers, in the
pool's layout) go out as a `KVChunk`, the block still filling going with the last chunk, which also carries the
first sampled token, its logprobs and the M-RoPE position delta; the request then ends on that engine
(``"kv_sent"``) and its blocks stay as evictable prefix cache like any finished request's. A decode engine admits
a ``KV_RECEIVE`` request with its whole reservation: the prompt's blocks are allocated at once (a local prefix hit
first: those are not shipped, ``skip_blocks``), each chunk is written into them and its full blocks' hashes
registered; the last chunk appends the first token and the sequence joins the scheduler as a decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.attention.kv_cache import KVCache
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_copy import block_dim, read_blocks, write_blocks
from services.worker.engine.request import TokenLogprobs
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class FirstToken:
    """What a decode engine needs beyond the KV to go on: the token the prefill sampled after the prompt, its
    logprobs when asked for, and the prompt's M-RoPE position delta (checked against the decode side's own)."""

    token_id: int
    logprobs: TokenLogprobs | None
    rope_delta: int


@dataclass(frozen=True)
class KVChunk:
    """Blocks ``first_block .. first_block + n`` of a request's prompt (``n``: the block dimension of ``keys``), in
    every layer, valid for the prompt's first ``num_tokens`` tokens; ``first_token`` on the last chunk only."""

    request_id: str
    first_block: int
    num_tokens: int
    keys: torch.Tensor
    values: torch.Tensor
    first_token: FirstToken | None = None

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class _Sending:
    seq: Sequence
    next_block: int  # the first block not shipped yet


class KVConnector:
    """One engine's KV transfers, both directions.

    Invariant: ``sending`` holds the live ``KV_SEND`` sequences (scheduled as any other); ``receiving`` the
    ``KV_RECEIVE`` sequences whose last chunk has not arrived: status ``RECEIVING``, in no scheduler queue, each
    holding its reservation and blocks for its whole prompt, ``num_computed_tokens`` the tokens written so far.
    """

    def __init__(self, block_manager: BlockManager, kv: KVCache) -> None:
        self.block_manager = block_manager
        self.kv = kv
        self.sending: dict[str, _Sending] = {}
        self.receiving: dict[str, Sequence] = {}
        self.outbox: list[KVChunk] = []

    @staticmethod
    def check(seq: Sequence, num_choices: int) -> None:
        """ValueError for a transfer this connector cannot make: more than one choice, or a constraint (its grammar
        state would have to cross over)."""
        if num_choices > 1 or seq.sampling.structured is not None:
            raise ValueError(f"request {seq.request_id!r}: a KV transfer takes one unconstrained choice")

    # ----- prefill side -----

    def start_send(self, seq: Sequence, skip_blocks: int) -> None:
        self.sending[seq.request_id] = _Sending(seq, min(skip_blocks, seq.max_num_blocks))

    def sends(self, seq: Sequence) -> bool:
        return seq.request_id in self.sending

    def export(self, chunks: list[ScheduledChunk]) -> None:
        """After a step's ``update``: ship the blocks it finished of each sending sequence (the last, partial one
        too when the chunk reached the prompt's end)."""
        size = self.block_manager.block_size
        for chunk in chunks:
            sending = self.sending.get(chunk.seq.request_id)
            if sending is None:
                continue
            seq = sending.seq
            done = seq.num_computed_tokens
            end = -(-done // size) if chunk.samples else done // size
            if end > sending.next_block:
                keys, values = read_blocks(self.kv, seq.block_table[sending.next_block : end])
                self.outbox.append(KVChunk(seq.request_id, sending.next_block, done, keys, values))
                sending.next_block = end

    def send_first_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """The prefill sampled ``token_id``: it goes with the request's last chunk (one without blocks when the last
        step finished none), and the request stops sending."""
        next_block = self.sending.pop(seq.request_id).next_block
        prompt = seq.num_prompt_tokens
        first = FirstToken(token_id, logprobs, seq.positions[0][prompt] - prompt)
        last = self.outbox[-1] if self.outbox and self.outbox[-1].request_id == seq.request_id else None
        if last is not None and last.num_tokens == prompt:
            self.outbox[-1] = KVChunk(last.request_id, last.first_block, prompt, last.keys, last.values, first)
            return
        keys, values = read_blocks(self.kv, [])
        self.outbox.append(KVChunk(seq.request_id, next_block, prompt, keys, values, first))

    def take(self) -> list[KVChunk]:
        """The chunks made since the last call, in order."""
        out, self.outbox = self.outbox, []
        return out

    # ----- decode side -----

    def start_receive(self, seq: Sequence) -> int:
        """Give an admitted ``KV_RECEIVE`` sequence its prompt's blocks (a local prefix hit first); the number of
        leading blocks the hit covers, which the sender skips."""
        bm = self.block_manager
        hit = bm.find_prefix(seq)
        if not bm.can_allocate(seq, seq.num_prompt_tokens, hit):
            raise RuntimeError(f"request {seq.name}: its reserved blocks are not free")
        bm.allocate(seq, seq.num_prompt_tokens, hit)
        seq.num_computed_tokens = seq.num_cached_tokens = hit.num_tokens
        seq.prefix_looked_up = True
        seq.status = SequenceStatus.RECEIVING
        self.receiving[seq.request_id] = seq
        return len(hit.block_ids)

    def skip_blocks(self, request_id: str) -> int:
        """The leading prompt blocks a receiving request took from this engine's prefix cache (not to be sent)."""
        return self.receiving[request_id].num_cached_tokens // self.block_manager.block_size

    def receives(self, seq: Sequence) -> bool:
        return self.receiving.get(seq.request_id) is seq

    def receive(self, chunk: KVChunk, expected_rope_delta: int | None = None) -> Sequence | None:
        """Write a chunk into its sequence's blocks (those not taken from the local prefix cache) and register the
        full ones' hashes; the sequence when this was its last chunk (taken out of ``receiving``), else None. A chunk
        of a request not receiving here (aborted, or migrated away) is dropped: None."""
        seq = self.receiving.get(chunk.request_id)
        if seq is None:
            return None
        dim = 1 + block_dim(self.kv.layout)
        n = chunk.keys.shape[dim]
        end = chunk.first_block + n
        if end > len(seq.block_table) or chunk.num_tokens > seq.num_prompt_tokens:
            past = f"blocks to {end}, {chunk.num_tokens} tokens"
            raise ValueError(f"request {seq.name}: KV chunk past its prompt ({past})")
        skip = max(seq.num_cached_tokens // self.block_manager.block_size - chunk.first_block, 0)  # hit blocks
        if n > skip:
            keys, values = chunk.keys.narrow(dim, skip, n - skip), chunk.values.narrow(dim, skip, n - skip)
            write_blocks(self.kv, seq.block_table[chunk.first_block + skip : end], keys, values)
        seq.num_computed_tokens = max(seq.num_computed_tokens, chunk.num_tokens)
        self.block_manager.cache_full_blocks(seq)
        if chunk.first_token is None:
            return None
        prompt = seq.num_prompt_tokens
        if chunk.num_tokens != prompt:
            raise ValueError(f"request {seq.name}: last KV chunk covers {chunk.num_tokens} of {prompt} prompt tokens")
        delta = seq.positions[0][prompt] - prompt
        if chunk.first_token.rope_delta != delta:
            theirs = chunk.first_token.rope_delta
            raise ValueError(f"request {seq.name}: the prefill's position delta {theirs} != this engine's {delta}")
        del self.receiving[seq.request_id]
        return seq

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended (finished or aborted) in any state: no more chunks for it, none sent."""
        if self.sending.pop(seq.request_id, None) is not None:  # ended before its first token: ship nothing more
            self.outbox = [c for c in self.outbox if c.request_id != seq.request_id]
        if self.receiving.get(seq.request_id) is seq:
            del self.receiving[seq.request_id]
