"""The model runner of a tensor-parallel rank: `ShardRunner` on every rank (its shard of the model, the same
block count as every other rank), `LeadRunner` on rank 0 (the engine's runner: it lays out each step, hands it to
the other ranks through the step channel, and runs its own share)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from services.models.base import PlacedEmbedding
from services.worker.engine.config import EngineConfig
from services.worker.engine.embeddings import EmbeddingPool
from services.worker.engine.model_runner import ModelRunner, RunOutput
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.step_input import PaddedRows, StepInput, build_step_input
from services.worker.engine.tensor_parallel.collectives import Collectives

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMessage:
    """A laid-out step as the other ranks need it: its ints and shape, without the scheduler's chunks; the media
    rows' offsets and row counts (the rows themselves follow by broadcast); the KV blocks to copy before it."""

    num_tokens: int
    ints: list[int]
    sample_rows: list[int]
    sample_at: int
    layout: Any
    padding: PaddedRows | None
    num_decodes: int
    max_context: int
    media: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]

    @classmethod
    def of(cls, step: StepInput, block_copies: list[tuple[int, int]]) -> StepMessage:
        media = [(p.offset, int(p.embedding.shape[0])) for p in step.placed]
        return cls(step.num_tokens, step.ints, step.sample_rows, step.sample_at, step.layout, step.padding,
                   step.num_decodes, step.max_context, media, block_copies)  # fmt: skip

    def step(self, placed: list[PlacedEmbedding]) -> StepInput:
        return StepInput(self.num_tokens, [], [], self.sample_rows, placed, self.ints, self.padding, self.layout,
                         self.sample_at, self.num_decodes, self.max_context)  # fmt: skip


STOP = "stop"
"""The channel message that ends a rank's loop."""


class ShardRunner(ModelRunner):
    """A `ModelRunner` over one rank's shard (``model`` already sharded and on its device).

    Invariant: every rank of the group holds ``num_blocks`` blocks, the fewest any rank's KV budget allows (each
    computes its own from its heads and memory, then they agree on the smallest), so a block id the lead's block
    manager hands out is a block on every rank.
    """

    def __init__(self, adapter: Any, model: torch.nn.Module, config: EngineConfig, group: Collectives) -> None:
        self.group = group
        super().__init__(adapter, model, config)

    def allocate_kv(self, kv_bytes: int) -> tuple[int, Any]:
        block_bytes = self.shape.block_bytes(self.block_size, self.dtype)
        scratch = 0 if self.config.cuda_graphs == "off" else 1
        agreed = self.group.all_reduce_min(
            kv_bytes // block_bytes - scratch, self.config.tensor_parallel_start_timeout_s
        )
        return super().allocate_kv((max(agreed, 0) + scratch) * block_bytes)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the rows of the laid-out ``step`` that sample: the decode graphs' path for a
        padded step, else eager (the same forward every rank runs, meeting in its collectives)."""
        if step.padding is not None:
            return self.graphs.run(step, self.all_logits).index_select(0, self.graphs.sample_rows(step))
        packed = self.io.upload(step.ints, torch.int64)
        rows = packed[step.sample_at : step.sample_at + len(step.sample_rows)]
        return self.adapter.compute_logits(self.model, self._hidden(step, packed).index_select(0, rows))

    def receive_media(self, message: StepMessage) -> list[PlacedEmbedding]:
        """The step's media rows, broadcast by rank 0, placed as its were."""
        if not message.media:
            return []
        total = sum(rows for _, rows in message.media)
        width = int(self.adapter.embedding_width)  # DeepStack levels travel with the rows (Qwen3-VL)
        buffer = self.group.broadcast(torch.empty(total, width, dtype=self.dtype, device=self.device))
        placed, at = [], 0
        for offset, rows in message.media:
            placed.append(PlacedEmbedding(offset, buffer[at : at + rows]))
            at += rows
        return placed

    def serve(self, channel: Any, alive: Any) -> None:
        """A non-zero rank's loop: each message from rank 0 is a step to run, until ``STOP`` (or rank 0 gone)."""
        while True:
            message = channel.receive(alive)
            if message is None or message == STOP:
                return
            if message.block_copies:
                self.copy_blocks(message.block_copies)
            self.forward(message.step(self.receive_media(message)))


class LeadRunner(ShardRunner):
    """Rank 0's runner, the engine's: ``run`` lays the step out as `ModelRunner.run` does, sends it to the other
    ranks (the message, then the media rows by broadcast) and runs rank 0's share; the sampled logits are whole
    here (the LM head gathers them). A collective that fails (a rank gone or silent past the group's timeout)
    ends every rank through ``ranks.lost``, then raises."""

    def __init__(self, adapter: Any, model: torch.nn.Module, config: EngineConfig, ranks: Any) -> None:
        self.ranks = ranks
        self.block_copies: list[tuple[int, int]] = []  # copied here since the last step's message
        super().__init__(adapter, model, config, ranks.group)

    def prepare(self, seq: Any) -> None:
        """As `ModelRunner.prepare`; once the ranks are lost, the engine-gone refusal instead (the worker answers
        UNAVAILABLE at admission, so no router places anything here in the second before it exits)."""
        if self.ranks.lost_cause is not None:
            from services.worker.engine_host.process_host import EngineGone

            raise EngineGone(f"tensor-parallel ranks lost ({self.ranks.lost_cause})")
        super().prepare(seq)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """As `ModelRunner.copy_blocks`; the other ranks copy the same pairs before the next step (its message)."""
        super().copy_blocks(pairs)
        self.block_copies += pairs

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], embeddings: EmbeddingPool) -> RunOutput:
        if self.ranks.lost_cause is not None:
            raise RuntimeError(f"tensor-parallel ranks lost ({self.ranks.lost_cause})")
        self.last_chunks = chunks
        bucket = self.graphs.bucket_for(chunks) if self.graphs is not None else None
        padding = self.graphs.padding(bucket, len(chunks)) if bucket is not None else None
        step = build_step_input(chunks, self.block_size, embeddings, padding)
        self.backend.lay_out(step, self.graphs.table_width if bucket is not None else None)
        step.close()
        try:
            copies, self.block_copies = self.block_copies, []
            self.ranks.channel.send(StepMessage.of(step, copies))
            if step.placed:
                rows = [p.embedding.to(device=self.device, dtype=self.dtype) for p in step.placed]
                self.group.broadcast(torch.cat(rows).contiguous())
            logits = self.forward(step)
        except RuntimeError as exc:
            self.ranks.lost(f"a collective failed: {exc}")
            raise
        return RunOutput(step.sampled, logits)

    def close(self) -> None:
        """Stop the other ranks (and wait for them)."""
        self.ranks.stop()
