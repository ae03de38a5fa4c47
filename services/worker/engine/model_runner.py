"""Runs one flattened step of the language model over paged KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.models.base import PlacedEmbedding, PlacedItem
from services.worker.engine.attention import (
    CONTEXT_KWARG,
    AttentionContext,
    ChunkSpan,
    DecodeGroup,
    KVCache,
    install_paged_attention,
)
from services.worker.engine.config import EngineConfig
from services.worker.engine.embeddings import EmbeddingPool
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence


@dataclass(frozen=True)
class KVShape:
    """What one KV block holds, from the model's text config."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(int(text.num_hidden_layers), int(text.num_key_value_heads), int(head_dim))

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of one block over all layers."""
        return 2 * self.num_layers * block_size * self.kv_heads * self.head_dim * dtype.itemsize


@dataclass(frozen=True)
class RunOutput:
    """Logits ``[N, vocab]`` for the chunks that sample, row i for ``sampled[i]``."""

    sampled: list[ScheduledChunk]
    logits: torch.Tensor


class ModelRunner:
    """Owns the per-layer KV block tensors (allocated once from the byte budget) and runs steps.

    Invariant: ``kv`` holds ``num_blocks`` blocks per layer and never grows; a step writes K/V only to
    the slots of the blocks the scheduler allocated to its chunks.
    """

    def __init__(self, adapter: Any, model: torch.nn.Module, config: EngineConfig) -> None:
        self.adapter = adapter
        self.model = model
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        self.shape = KVShape.of(model)
        self.dtype = dtype = config.torch_dtype
        model_dtype = model.get_input_embeddings().weight.dtype
        if model_dtype != dtype:
            raise ValueError(f"EngineConfig.dtype is {dtype} but the model's weights are {model_dtype}")
        self.num_blocks = config.kv_cache_bytes // self.shape.block_bytes(config.block_size, dtype)
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no block of "
                f"{self.shape.block_bytes(config.block_size, dtype)} bytes"
            )
        dims = (self.shape.kv_heads, self.num_blocks, config.block_size, self.shape.head_dim)
        layers = range(self.shape.num_layers)
        self.kv = KVCache(
            keys=[torch.zeros(dims, dtype=dtype, device=self.device) for _ in layers],
            values=[torch.zeros(dims, dtype=dtype, device=self.device) for _ in layers],
        )
        install_paged_attention(model)

    def prepare(self, seq: Sequence) -> None:
        """Compute the sequence's positions for every token it may hold (raises ValueError on bad media)."""
        items = [PlacedItem(m.offset, tuple(m.grid_thw)) for m in seq.media]
        prompt = self.adapter.prompt_positions(self.model, seq.token_ids[: seq.num_prompt_tokens], items)
        tail = self.adapter.decode_positions(seq.num_prompt_tokens, seq.sampling.max_tokens, prompt.rope_delta)
        seq.positions = torch.cat([prompt.positions, tail.to(prompt.positions.device)], dim=1)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], embeddings: EmbeddingPool) -> RunOutput:
        """Compute ``chunks`` in one forward; logits only at the last token of the chunks that sample."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=_start)  # by context, for grouping
        ordered = decodes + [c for c in chunks if c.num_tokens > 1]
        ids: list[int] = []
        slots: list[int] = []
        placed: list[PlacedEmbedding] = []
        sample_rows: list[int] = []
        size = self.block_size
        for chunk in ordered:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            if seq.media:
                placed.extend(_placed_rows(seq, start, end, len(ids), embeddings))
            table = seq.block_table
            if end - start == 1:
                ids.append(seq.token_ids[start])
                slots.append(table[start // size] * size + start % size)
            else:
                ids.extend(seq.token_ids[start:end])
                slots.extend(table[i // size] * size + i % size for i in range(start, end))
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
        positions = torch.cat([c.seq.positions[:, c.start : c.start + c.num_tokens] for c in ordered], dim=1)
        ctx = self._attention_context(ordered, len(decodes), slots)
        model, adapter = self.model, self.adapter
        embeds = adapter.embed_prompt(model, torch.tensor(ids, device=self.device), placed)
        position_ids = positions.to(self.device)[:, None, :]
        hidden = adapter.forward_hidden(model, embeds[None], position_ids, **{CONTEXT_KWARG: ctx})
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = adapter.compute_logits(model, hidden[0].index_select(0, rows))
        return RunOutput([c for c in ordered if c.samples], logits)

    def _attention_context(self, ordered: list[ScheduledChunk], num_decodes: int, slots: list[int]) -> AttentionContext:
        size, device = self.block_size, self.device
        lengths = [c.start + 1 for c in ordered[:num_decodes]]  # ascending
        split = _split_point([-(-n // size) for n in lengths])
        groups = [
            self._decode_group(ordered[lo:hi], lengths[lo:hi])
            for lo, hi in ((0, split), (split, num_decodes))
            if hi > lo
        ]
        spans = []
        query_start = num_decodes
        for chunk in ordered[num_decodes:]:
            context_len = chunk.start + chunk.num_tokens
            block_ids = torch.tensor(chunk.seq.block_table[: -(-context_len // size)], device=device)
            spans.append(ChunkSpan(query_start, chunk.num_tokens, context_len, block_ids))
            query_start += chunk.num_tokens
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        return AttentionContext(self.kv, slot_mapping, groups, spans)

    def _decode_group(self, decodes: list[ScheduledChunk], lengths: list[int]) -> DecodeGroup:
        size, device = self.block_size, self.device
        width = -(-lengths[-1] // size)
        rows = [c.seq.block_table[:width] for c in decodes]
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        span = torch.arange(width * size, device=device)
        outside = span[None, :] >= torch.tensor(lengths, device=device)[:, None]
        mask = torch.zeros(outside.shape, dtype=self.dtype, device=device).masked_fill_(outside, float("-inf"))
        return DecodeGroup(len(decodes), table, mask[:, None, None, :])


def _start(chunk: ScheduledChunk) -> int:
    return chunk.start


def _split_point(widths: list[int], group_cost: int = 64) -> int:
    """Where to cut ascending context widths (in blocks) into two padded groups, or 0 to keep one.

    Padding costs one block-row per missing block; a second group costs about ``group_cost`` of them.
    """
    n = len(widths)
    if n < 2:
        return 0
    best, best_cost = 0, n * widths[-1]
    for k in range(1, n):
        cost = k * widths[k - 1] + (n - k) * widths[-1] + group_cost
        if cost < best_cost:
            best, best_cost = k, cost
    return best


def _placed_rows(seq: Sequence, start: int, end: int, row: int, embeddings: EmbeddingPool) -> list[PlacedEmbedding]:
    """The media rows of tokens ``[start, end)`` of ``seq``, placed at flat row ``row`` onwards."""
    placed = []
    for item in seq.media:
        lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
        if lo < hi:
            rows = embeddings.get(item.mm_hash)[lo - item.offset : hi - item.offset]
            placed.append(PlacedEmbedding(row + lo - start, rows))
    return placed
