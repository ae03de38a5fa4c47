"""The scheduler side of KV transfer: which blocks of which request to ship after a step, and where shipped ones land.

Prefill/decode disaggregation as vLLM v1 splits its KV connector: this piece decides what to send and receive
(block indices, token counts, hashes), `kv_copy.py` copies the bytes. A prefill engine marks a request
``KV_SEND``: after every step that computed some of its prompt, the blocks that step finished (all layers, in the
pool's layout) go out as a `KVChunk`, the block still filling going with the last chunk, which also carries the
first sampled token, its logprobs and the M-RoPE position delta; the request then ends on that engine
(``"kv_sent"``) and its blocks stay as evictable prefix cache like any finished request's. A decode engine admits
a ``KV_RECEIVE`` request with its whole reservation: the prompt's blocks are allocated at once (a local prefix hit
first: those are not shipped, ``skip_blocks``), each chunk is written into them and its full blocks' hashes
registered; the last chunk appends the first token and the sequence joins the scheduler as a decode. A received
chunk is checked when it arrives and written in pieces of whole blocks (``KV_PIECE_BYTES``) before the following
steps: while sequences decode, for at most ``KV_WRITE_SHARE`` of the last step's time a gap, so a burst of
arriving KV never stretches a decode's inter-token gap by more than that.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from services.worker.engine.attention.kv_cache import KVCache
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_copy import block_dim, read_blocks, write_blocks
from services.worker.engine.request import TokenLogprobs
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence, SequenceStatus

KV_PIECE_BYTES = 1 << 20
"""A received chunk is written in pieces of whole blocks of at most this many bytes (one block at least)."""
KV_WRITE_SHARE = 0.25
"""While sequences decode, the pieces written before a step take at most this share of the last step's time (one
piece at least, so every transfer advances)."""


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


@dataclass(frozen=True)
class _Piece:
    """Part of a received chunk: ``keys``/``values`` for pool ``blocks`` of ``seq``, after which its prompt's first
    ``num_tokens`` tokens are in the pool; ``first_token`` on the last piece of the last chunk."""

    seq: Sequence
    blocks: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    num_tokens: int
    first_token: FirstToken | None


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
        self.queued: deque[_Piece] = deque()  # received, checked, not yet written (in arrival order)

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

    def receive(self, chunk: KVChunk) -> None:
        """Check a chunk against its sequence (ValueError: past its prompt, or a last chunk that does not end it)
        and queue it for ``write`` in pieces (those of blocks taken from the local prefix cache skipped). A chunk
        of a request not receiving here (aborted, or migrated away) is dropped."""
        seq = self.receiving.get(chunk.request_id)
        if seq is None:
            return
        dim = 1 + block_dim(self.kv.layout)
        n = chunk.keys.shape[dim]
        end = chunk.first_block + n
        if end > len(seq.block_table) or chunk.num_tokens > seq.num_prompt_tokens:
            past = f"blocks to {end}, {chunk.num_tokens} tokens"
            raise ValueError(f"request {seq.name}: KV chunk past its prompt ({past})")
        first = chunk.first_token
        if first is not None:
            prompt = seq.num_prompt_tokens
            if chunk.num_tokens != prompt:
                covers = f"{chunk.num_tokens} of {prompt} prompt tokens"
                raise ValueError(f"request {seq.name}: last KV chunk covers {covers}")
            delta = seq.positions[0][prompt] - prompt
            if first.rope_delta != delta:
                theirs = first.rope_delta
                raise ValueError(f"request {seq.name}: the prefill's position delta {theirs} != this engine's {delta}")
        size = self.block_manager.block_size
        skip = min(max(seq.num_cached_tokens // size - chunk.first_block, 0), n)  # prefix-hit blocks
        per_piece = max(1, KV_PIECE_BYTES * n // max(chunk.nbytes, 1))  # blocks
        for at in range(chunk.first_block + skip, end, per_piece):
            count = min(per_piece, end - at)
            keys = chunk.keys.narrow(dim, at - chunk.first_block, count)
            values = chunk.values.narrow(dim, at - chunk.first_block, count)
            tokens = min(chunk.num_tokens, (at + count) * size)
            self.queued.append(_Piece(seq, seq.block_table[at : at + count], keys, values, tokens, None))
        if first is not None or not n > skip:  # the first token, or the token count of a chunk with nothing to write
            empty = chunk.keys.narrow(dim, 0, 0), chunk.values.narrow(dim, 0, 0)
            self.queued.append(_Piece(seq, [], *empty, chunk.num_tokens, first))

    def write(self, step_s: float | None) -> list[tuple[Sequence, FirstToken]]:
        """Write queued pieces in order, for at most ``KV_WRITE_SHARE`` of ``step_s`` (the last step's time, while
        sequences decode; None: all of them), one at least; register the blocks they fill. The sequences whose
        last piece was written (taken out of ``receiving``), each with its first token. Pieces of a sequence no
        longer receiving here are dropped."""
        deadline = None if step_s is None else time.perf_counter() + KV_WRITE_SHARE * step_s
        done = []
        while self.queued:
            piece = self.queued.popleft()
            seq = piece.seq
            if self.receiving.get(seq.request_id) is not seq:
                continue
            if piece.blocks:
                write_blocks(self.kv, piece.blocks, piece.keys, piece.values)
            seq.num_computed_tokens = max(seq.num_computed_tokens, piece.num_tokens)
            self.block_manager.cache_full_blocks(seq)
            if piece.first_token is not None:
                del self.receiving[seq.request_id]
                done.append((seq, piece.first_token))
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return done

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended (finished or aborted) in any state: no more chunks for it, none sent."""
        if self.sending.pop(seq.request_id, None) is not None:  # ended before its first token: ship nothing more
            self.outbox = [c for c in self.outbox if c.request_id != seq.request_id]
        if self.receiving.get(seq.request_id) is seq:
            del self.receiving[seq.request_id]
