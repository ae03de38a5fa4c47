"""Runs one flattened step of the language model over paged KV."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from services.models.base import PlacedItem
from services.worker.engine.attention import (
    CONTEXT_KWARG,
    AttentionContext,
    ChunkSpan,
    DecodeGroup,
    KVCache,
    install_paged_attention,
)
from services.worker.engine.config import EngineConfig
from services.worker.engine.decode_kernel import DecodeKernel, load_decode_kernel
from services.worker.engine.embeddings import EmbeddingPool
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_input import GROUP_COST_BLOCKS, StepInput, build_step_input


@dataclass(frozen=True)
class KVShape:
    """What one KV block holds, from the model's text config."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        return cls.of_config(model.config)

    @classmethod
    def of_config(cls, config: Any) -> KVShape:
        """From a transformers config (its text config is used), without loading weights."""
        text = config.get_text_config()
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

    Decodes go through the compiled CPU kernel when ``config.attention_backend`` is ``"auto"`` and it
    applies (float32 on the CPU, 16-token blocks, head dims a multiple of 16) and builds; else SDPA.
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
        shape = self.shape
        self.decode_kernel: DecodeKernel | None = None
        if config.attention_backend == "auto" and DecodeKernel.applies(
            config.block_size, shape.head_dim, dtype, self.device
        ):
            self.decode_kernel = load_decode_kernel()
        self.kv = KVCache.allocate(
            shape.num_layers, shape.kv_heads, self.num_blocks, config.block_size, shape.head_dim, dtype, self.device,
            keys_dim_major=self.decode_kernel is not None,
        )  # fmt: skip
        # the kernel reads only each row's own blocks, so padding tables to one width costs nothing
        self._decode_group_cost = GROUP_COST_BLOCKS if self.decode_kernel is None else _ONE_GROUP
        self._arange = torch.arange(1024, device=self.device)
        self._zero = torch.zeros((), dtype=dtype, device=self.device)
        self._minus_inf = torch.full((), float("-inf"), dtype=dtype, device=self.device)
        install_paged_attention(model)

    def prepare(self, seq: Sequence) -> None:
        """Compute the sequence's positions for every token it may hold (raises ValueError on bad media).

        Kept as three plain lists (one per M-RoPE axis): a step reads them without tensor ops.
        """
        items = [PlacedItem(m.offset, tuple(m.grid_thw)) for m in seq.media]
        prompt = self.adapter.prompt_positions(self.model, seq.token_ids[: seq.num_prompt_tokens], items)
        tail = self.adapter.decode_positions(seq.num_prompt_tokens, seq.sampling.max_tokens, prompt.rope_delta)
        seq.positions = torch.cat([prompt.positions.cpu(), tail.cpu()], dim=1).tolist()

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], embeddings: EmbeddingPool) -> RunOutput:
        """Compute ``chunks`` in one forward; logits only at the last token of the chunks that sample."""
        step = build_step_input(chunks, self.block_size, embeddings, self._decode_group_cost)
        packed = torch.frombuffer(array("q", step.ints), dtype=torch.long).to(self.device)  # 3x torch.tensor's speed
        n, num_sampled = step.num_tokens, len(step.sampled)
        ctx = self._attention_context(step, packed)
        model, adapter = self.model, self.adapter
        embeds = adapter.embed_prompt(model, packed[:n], step.placed)
        position_ids = packed[2 * n : 5 * n].view(3, 1, n)
        hidden = adapter.forward_hidden(
            model, embeds[None], position_ids, attention_mask=_NO_MASK, **{CONTEXT_KWARG: ctx}
        )
        rows = packed[5 * n : 5 * n + num_sampled]
        logits = adapter.compute_logits(model, hidden[0].index_select(0, rows))
        return RunOutput(step.sampled, logits)

    def _attention_context(self, step: StepInput, packed: torch.Tensor) -> AttentionContext:
        """Decode groups and chunk spans as views of ``packed``; masks built once for all layers."""
        size, n = self.block_size, step.num_tokens
        span = self._span(max([g.width * size for g in step.decodes] + [c.context_len for c in step.chunks] + [1]))
        groups = []
        for g in step.decodes:
            block_ids = packed[g.table_at : g.table_at + g.num_rows * g.width]
            lengths = packed[g.lengths_at : g.lengths_at + g.num_rows]
            mask = None
            if self.decode_kernel is None:
                mask = self._additive(span[: g.width * size][None, :] < lengths[:, None])[:, None, None, :]
            groups.append(DecodeGroup(g.num_rows, block_ids, lengths, mask))
        spans = []
        for c in step.chunks:
            if c.num_blocks == 0:
                spans.append(ChunkSpan(c.query_start, c.query_len, c.context_len, None, None))
                continue
            block_ids = packed[c.blocks_at : c.blocks_at + c.num_blocks]
            first = c.context_len - c.query_len  # the chunk's first token's index in its context
            inside = span[: c.context_len][None, :] <= span[first : c.context_len][:, None]
            spans.append(ChunkSpan(c.query_start, c.query_len, c.context_len, block_ids, self._additive(inside)))
        slots = packed[n : 2 * n]
        key_slots = self.kv.key_slots(slots, size, self.shape.head_dim)
        return AttentionContext(self.kv, slots, key_slots, groups, spans, self.decode_kernel)

    def _additive(self, inside: torch.Tensor) -> torch.Tensor:
        """0 where ``inside``, -inf elsewhere: built once per step (SDPA converts a bool mask per call)."""
        return torch.where(inside, self._zero, self._minus_inf)

    def _span(self, length: int) -> torch.Tensor:
        """``arange(length)`` or longer, on the device; grown by doubling, reused across steps."""
        if self._arange.shape[0] < length:
            self._arange = torch.arange(max(length, 2 * self._arange.shape[0]), device=self.device)
        return self._arange


_ONE_GROUP = 1 << 40
"""A group cost no padding outweighs: all decodes in one group."""

_NO_MASK = {"full_attention": None}
"""Given as ``attention_mask``: transformers builds no mask (causality is ``paged_attention``'s job)."""
