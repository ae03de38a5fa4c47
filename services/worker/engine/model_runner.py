"""Runs one flattened step of the language model over paged KV, with the chosen attention backend."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.heap import keep_freed_memory
from services.models.base import language_model_positions, media_forward_kwargs
from services.models.lean_decoder import LeanDecoder, StepAttention, projection_groups
from services.models.packed_linear import pack_linears
from services.worker.engine.attention import (
    GRAPHED_BY_DEFAULT,
    VARLEN_BACKENDS,
    choose_backend,
    default_block_size,
    make_backend,
)
from services.worker.engine.attention.backend import CONTEXT_KWARG, install_paged_attention
from services.worker.engine.attention.kv_cache import KVCache, KVShape
from services.worker.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
from services.worker.engine.cuda_graphs import DecodeGraphs
from services.worker.engine.decode_batch import DecodeBatch
from services.worker.engine.embeddings import EmbeddingPool
from services.worker.engine.host_device import HostDevice
from services.worker.engine.kv_copy import copy_blocks
from services.worker.engine.layer_kernel import load_layer_kernel
from services.worker.engine.memory import kv_budget, profile_cuda
from services.worker.engine.sampler import filter_top_k_top_p
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_input import StepInput, build_step_input
from services.worker.engine.step_threads import StepThreads, resolve_threads

log = logging.getLogger(__name__)

__all__ = ["ModelRunner", "RunOutput"]


@dataclass(frozen=True)
class RunOutput:
    """Logits ``[N, vocab]`` on the device for the chunks that sample, row i for ``sampled[i]``."""

    sampled: list[ScheduledChunk]
    logits: torch.Tensor


class ModelRunner:
    """Owns the attention backend, the KV cache (allocated once) and the decode graphs; runs steps.

    Built in the steps nano-vllm names, in order, each callable alone: ``resolve_config`` (every automatic
    setting but the KV bytes), ``prepare_cpu`` (on the CPU: the C heap keeps freed memory, linear layers packed
    where bit-identical), ``choose_forward`` (the lean forward where it is transformers' bit for bit),
    ``kv_bytes_after_warm_up`` (on CUDA a warm-up step profiles memory), ``allocate_kv``
    and ``capture_graphs``. ``config`` is the given one with everything automatic resolved (backend name, block
    size, graph mode, max model length, KV bytes): the engine adopts it. Invariant: ``kv`` holds ``num_blocks``
    blocks per layer for sequences, plus, with decode graphs, one scratch block (id ``num_blocks``) that no
    sequence owns; it never grows. A step writes K/V only to the slots of the blocks the scheduler allocated to
    its chunks, or to the scratch block.
    """

    def __init__(self, adapter: Any, model: torch.nn.Module, config: EngineConfig) -> None:
        self.adapter = adapter
        self.model = model
        self.config = config = resolve_config(config, model, int(adapter.max_context))
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.shape = KVShape.of(model)
        self.block_size = config.block_size
        self.max_model_len = int(config.max_model_len or adapter.max_context)
        self.backend = make_backend(config.attention_backend, self.block_size, self.device, self.dtype,
                                    self.shape.head_dim)  # fmt: skip
        self.io = HostDevice(self.device)
        self.threads = StepThreads(resolve_threads(config.prefill_threads, self.device, config.tensor_parallel_size))
        self.decodes = DecodeBatch(self.block_size, self.backend)  # eager decode steps advanced in place
        self.prepare_cpu()
        install_paged_attention(model)
        self.lean = self.choose_forward()
        if not config.kv_cache_bytes:
            self.config = config = dataclasses.replace(config, kv_cache_bytes=self.kv_bytes_after_warm_up())
        self.num_blocks, self.kv = self.allocate_kv(config.kv_cache_bytes)
        self.graphs = self.capture_graphs()
        self.last_chunks: list[ScheduledChunk] = []  # the last step's (a benchmark reruns them: staged_forward)
        log.info(
            "attention backend %s on %s (%s): %d KV blocks of %d tokens, decode graphs %s",
            config.attention_backend,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_blocks,
            self.block_size,
            config.cuda_graphs,
        )

    def prepare_cpu(self) -> None:
        """On the CPU: the process's C heap keeps the memory a step frees (services/common/heap.py) and the model's
        linear layers take packed weights where the packed product is ``F.linear``'s bits, a decoder layer's q/k/v
        and gate/up as one product each (services/models/packed_linear.py); nothing on another device."""
        if self.device.type != "cpu":
            return
        keep_freed_memory()
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        pack_linears(self.model, projection_groups(decoder) if decoder is not None else [])

    def choose_forward(self) -> LeanDecoder | None:
        """The lean language-model forward when its probe matches transformers' forward exactly (the engine's
        steps then take it, but for steps with DeepStack rows), on the CPU with its norms and rotary in C where
        that matches too (layer_kernel.py); None keeps transformers' forward."""

        def reference(embeds: torch.Tensor, positions: torch.Tensor, attention: StepAttention) -> torch.Tensor:
            kwargs = {"attention_mask": _NO_MASK, CONTEXT_KWARG: attention}
            return self.adapter.forward_hidden(self.model, embeds, positions, **kwargs)

        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        if decoder is None:
            return None
        positions = functools.partial(language_model_positions, self.adapter)
        lean = LeanDecoder.probe(decoder, reference, self.device, self.dtype, positions)
        kernel = load_layer_kernel() if lean is not None and self.device.type == "cpu" else None
        if kernel is None or not kernel.matches_torch(int(lean.norm.weight.shape[-1]), self.dtype):
            return lean
        return LeanDecoder.probe(decoder, reference, self.device, self.dtype, positions, kernel) or lean

    def kv_bytes_after_warm_up(self) -> int:
        """The KV budget when none is configured: ``CPU_KV_CACHE_BYTES`` off CUDA; on CUDA what
        ``gpu_memory_utilization`` leaves after the weights, a warm-up of the largest step and the embeddings."""
        config = self.config
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        tokens = config.max_num_batched_tokens
        profile = profile_cuda(self.device, lambda: self.warm_up(tokens, min(config.max_num_seqs, tokens)))
        budget = kv_budget(profile, config.gpu_memory_utilization, config.embedding_buffer_bytes)
        log.info(
            "GPU memory: %.1f GiB total, warm-up peak %.2f GiB, %.2f GiB outside torch: %.2f GiB for KV",
            profile.total / 2**30,
            profile.peak / 2**30,
            profile.other / 2**30,
            budget / 2**30,
        )
        return budget

    def allocate_kv(self, kv_bytes: int) -> tuple[int, KVCache]:
        """The sequences' block count and a KV cache of ``kv_bytes`` in the backend's layout: as many whole
        blocks as fit, one of them the decode graphs' scratch block when there are graphs. ValueError when
        ``kv_bytes`` holds no block for sequences."""
        block_bytes = self.shape.block_bytes(self.block_size, self.dtype)
        scratch = 0 if self.config.cuda_graphs == "off" else 1
        num_blocks = kv_bytes // block_bytes - scratch
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_bytes} holds no block of {block_bytes} bytes")
        layout = self.backend.kv_layout
        kv = KVCache.allocate(self.shape, num_blocks + scratch, self.block_size, self.dtype, self.device, layout)
        return num_blocks, kv

    def capture_graphs(self) -> DecodeGraphs | None:
        """The decode graphs over ``kv`` for the resolved graph mode: None when ``off``; the padded static
        buffers without capturing when ``eager``; captured on the engine's device when ``auto`` or ``on``."""
        mode = self.config.cuda_graphs
        if mode == "off":
            return None
        width = -(-self.max_model_len // self.block_size)
        vocab = int(self.model.config.get_text_config().vocab_size)
        capture = mode in ("auto", "on")
        graphs = DecodeGraphs(self.backend, self.io, self.config.max_num_seqs, width, self.num_blocks, vocab,
                              self.dtype, capture=capture)  # fmt: skip
        if capture:
            with torch.cuda.device(self.device):  # capture on the engine's device, whatever is current here
                graphs.capture(self.all_logits)
        return graphs

    def prepare(self, seq: Sequence) -> None:
        """Compute the sequence's positions for every token it may hold (raises ValueError on bad media).

        Kept as three plain lists (one per M-RoPE axis), computed on the host: a step reads them without
        tensor ops and preparing a request touches no device.
        """
        original = seq.num_prompt_tokens - seq.num_generated_before  # a migrated request's own prompt
        prompt = self.adapter.prompt_positions(None, seq.token_ids[:original], seq.media)
        tail = self.adapter.decode_positions(original, seq.max_num_tokens - original, prompt.rope_delta)
        seq.positions = torch.cat([prompt.positions, tail], dim=1).tolist()

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy ``(source, destination)`` blocks of the KV pool in every layer (before the step that reads them)."""
        copy_blocks(self.kv, pairs)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], embeddings: EmbeddingPool) -> RunOutput:
        """Compute ``chunks`` in one forward; logits only at the last token of the chunks that sample.

        Decode-only steps go through the decode graphs when there are any; the rest run eagerly, a decode step of the
        sequences of the last one advanced in place (``decodes``); a large eager step with ``threads``' count.
        """
        self.last_chunks = chunks
        bucket = self.graphs.bucket_for(chunks) if self.graphs is not None else None
        if bucket is not None:
            self.decodes.forget()
            step = build_step_input(chunks, self.block_size, embeddings, self.graphs.padding(bucket, len(chunks)))
            self.backend.lay_out(step, self.graphs.table_width)
            step.close()
            logits = self.graphs.run(step, self.all_logits).index_select(0, self.graphs.sample_rows(step))
            return RunOutput(step.sampled, logits)
        step = self.decodes.advance(chunks)
        if step is None:
            step = build_step_input(chunks, self.block_size, embeddings)
            self.backend.lay_out(step)
            step.close()
            step = self.decodes.keep(step, chunks)
        packed = self.io.upload(step.ints, torch.int64)
        with self.threads.for_step(step.num_tokens):
            logits = self._sampled_logits(step, packed, self.backend.context(step, packed, self.kv))
        return RunOutput(step.sampled, logits)

    @torch.inference_mode()
    def staged_forward(self, chunks: list[ScheduledChunk], embeddings: EmbeddingPool) -> Callable[[], torch.Tensor]:
        """The eager step of ``chunks`` laid out, uploaded and given its attention context now, and the call that
        runs only the model on it (embedding, language model with its attention over the KV, the head at the rows
        that sample), returning those logits: a step without scheduling, metadata, sampling or outputs, which
        `epd bench engine` times as the bare forward. Each call rewrites the chunks' K/V into their slots, so give
        it chunks already computed (``last_chunks``): it writes the same values again."""
        step = build_step_input(chunks, self.block_size, embeddings)
        self.backend.lay_out(step)
        step.close()
        packed = self.io.upload(step.ints, torch.int64)
        ctx = self.backend.context(step, packed, self.kv)
        return torch.inference_mode()(lambda: self._sampled_logits(step, packed, ctx))

    def _sampled_logits(self, step: StepInput, packed: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the rows of ``step`` that sample (``packed``: its ints on the device)."""
        rows = packed[step.sample_at : step.sample_at + len(step.sample_rows)]
        return self.adapter.compute_logits(self.model, self._hidden(step, packed, ctx).index_select(0, rows))

    def _hidden(self, step: StepInput, packed: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Last hidden states ``[T, hidden]`` of every row of ``step`` (``packed``: its ints on the device; ``ctx``
        its attention context, built here when None)."""
        n = step.num_tokens
        if ctx is None:
            ctx = self.backend.context(step, packed, self.kv)
        embeds = self.adapter.embed_prompt(self.model, packed[:n], step.placed)
        media = media_forward_kwargs(self.adapter, step.placed, n)  # DeepStack levels of the step's media rows
        position_ids = packed[2 * n : 5 * n].view(3, 1, n)
        if self.lean is not None and not media:
            return self.lean(embeds[None], position_ids, ctx)[0]
        hidden = self.adapter.forward_hidden(
            self.model, embeds[None], position_ids, attention_mask=_NO_MASK, **media, **{CONTEXT_KWARG: ctx}
        )
        return hidden[0]

    def all_logits(self, step: StepInput, packed: torch.Tensor) -> torch.Tensor:
        """Logits of every row (the decode graphs' forward)."""
        return self.adapter.compute_logits(self.model, self._hidden(step, packed))

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_logits: int) -> None:
        """One forward of ``num_tokens`` tokens without KV (plain SDPA) and logits for ``num_logits`` rows:
        the largest step's activations, for sizing the KV cache from what is left."""
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device).expand(3, 1, num_tokens)
        embeds = self.adapter.embed_prompt(self.model, ids, [])
        hidden = self.adapter.forward_hidden(self.model, embeds[None], positions, attention_mask=_NO_MASK)
        logits = self.adapter.compute_logits(self.model, hidden[0, -num_logits:]).float()
        rows, vocab = logits.shape
        top_k = torch.full((rows,), max(vocab // 2, 1), device=self.device)
        top_p = torch.full((rows,), 0.9, device=self.device)
        filter_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)  # the sampler's largest temporaries


def resolve_config(config: EngineConfig, model: torch.nn.Module, max_context: int) -> EngineConfig:
    """``config`` with every automatic setting resolved for ``model`` but the KV bytes (which need the device):
    the attention backend (``choose_backend``), the block size (the backend's when 0), the decode graph mode
    (``resolve_graph_mode``) and the max model length (``max_context``, the model's, when unset). ValueError when
    the model's weights are not in ``config.dtype``."""
    dtype = config.torch_dtype
    model_dtype = model.get_input_embeddings().weight.dtype
    if model_dtype != dtype:
        raise ValueError(f"EngineConfig.dtype is {dtype} but the model's weights are {model_dtype}")
    device = torch.device(config.device)
    head_dim = KVShape.of(model).head_dim
    name = choose_backend(config.attention_backend, device, dtype, head_dim, config.block_size)
    return dataclasses.replace(
        config,
        attention_backend=name,
        block_size=config.block_size or default_block_size(name),
        cuda_graphs=resolve_graph_mode(config.cuda_graphs, device, name, _rope_type(model)),
        max_model_len=config.max_model_len or max_context,
    )


def resolve_graph_mode(requested: str, device: torch.device, backend: str, rope_type: str) -> str:
    """``off``, ``eager``, ``on`` or ``auto`` (both capture), from the configured mode and what runs here.

    ``auto`` captures only with ``flash`` or ``triton`` on CUDA: ``flash-reference`` pads every row to the graphs'
    fixed ``max_k`` (the longest allowed context), so its graphs serve checks with a short ``max_model_len``
    (``on``), not production. A rope that branches on position values (dynamic, longrope) cannot be captured.
    """
    varlen = backend in VARLEN_BACKENDS
    if requested in ("eager", "on") and not varlen:
        raise ValueError(f"decode graphs need a varlen attention backend ({', '.join(VARLEN_BACKENDS)})")
    if requested == "on" and device.type != "cuda":
        raise ValueError("cuda_graphs='on' captures CUDA graphs: it needs a CUDA device (use 'eager' elsewhere)")
    if requested == "auto":
        requested = "auto" if device.type == "cuda" and backend in GRAPHED_BY_DEFAULT else "off"
    if requested in ("auto", "on") and rope_type in UNCAPTURABLE_ROPE:
        log.warning("decode graphs off: rope type %s branches on position values", rope_type)
        return "off"
    return requested


def _rope_type(model: torch.nn.Module) -> str:
    text = model.config.get_text_config()
    parameters = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return str(parameters.get("rope_type", parameters.get("type", "default")))


UNCAPTURABLE_ROPE = ("dynamic", "longrope")
_NO_MASK = {"full_attention": None}
"""Given as ``attention_mask``: transformers builds no mask (causality is the attention backend's job)."""
