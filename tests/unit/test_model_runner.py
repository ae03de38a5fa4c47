"""The model runner's construction steps, each called alone on the tiny model on the CPU: resolve config, warm up,
allocate KV, capture graphs; and the runner's config is the resolved one plus the KV bytes (what the engine adopts)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from services.worker.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
from services.worker.engine.cuda_graphs import DecodeGraphs
from services.worker.engine.engine import Engine
from services.worker.engine.model_runner import ModelRunner, resolve_config

GRAPHED = EngineConfig(attention_backend="flash-reference", cuda_graphs="eager", max_model_len=64, max_num_seqs=4)
"""The padded static-buffer path the CPU runs without capturing (decode graphs, a scratch block)."""


@pytest.fixture(scope="module")
def plain(loaded: tuple[Any, Any]) -> ModelRunner:
    adapter, model = loaded
    return ModelRunner(adapter, model, EngineConfig(attention_backend="sdpa", kv_cache_bytes=1 << 20))


@pytest.fixture(scope="module")
def graphed(loaded: tuple[Any, Any]) -> ModelRunner:
    adapter, model = loaded
    return ModelRunner(adapter, model, dataclasses.replace(GRAPHED, kv_cache_bytes=1 << 20))


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_resolve_config_settles_every_automatic_setting_but_the_kv_bytes(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    given = EngineConfig()
    resolved = resolve_config(given, model, adapter.max_context)
    assert given == EngineConfig()  # a new config; the given one is left as it was
    assert (resolved.attention_backend, resolved.block_size, resolved.cuda_graphs) == ("cpu-kernel", 16, "off")
    assert resolved.max_model_len == adapter.max_context and resolved.kv_cache_bytes == 0
    explicit = resolve_config(GRAPHED, model, adapter.max_context)
    assert (explicit.attention_backend, explicit.block_size, explicit.cuda_graphs) == ("flash-reference", 16, "eager")
    assert explicit.max_model_len == 64
    assert resolve_config(EngineConfig(block_size=32), model, 100).attention_backend == "sdpa"  # kernel: 16 only


def test_resolve_config_refuses_what_cannot_run(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    with pytest.raises(ValueError, match="the model's weights are torch.float32"):
        resolve_config(EngineConfig(dtype="bfloat16"), model, adapter.max_context)
    with pytest.raises(ValueError, match="need a varlen attention backend"):
        resolve_config(EngineConfig(attention_backend="sdpa", cuda_graphs="eager"), model, adapter.max_context)


def test_warm_up_leaves_the_kv_cache_alone(plain: ModelRunner) -> None:
    """The warm-up forward (what sizes KV on CUDA) runs without KV: plain SDPA, nothing written to the blocks."""
    for t in plain.kv.keys + plain.kv.values:
        t.fill_(1.5)  # not the zeros of a fresh cache, which a forward writing zeros would leave as they were
    before = [t.clone() for t in plain.kv.keys + plain.kv.values]
    plain.warm_up(48, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, plain.kv.keys + plain.kv.values, strict=True))
    assert plain.kv_bytes_after_warm_up() == CPU_KV_CACHE_BYTES  # off CUDA: the fixed budget, no profile


def test_allocate_kv_cuts_the_budget_into_whole_blocks(plain: ModelRunner, graphed: ModelRunner) -> None:
    block = plain.shape.block_bytes(16, torch.float32)
    own = plain.kv
    num_blocks, kv = plain.allocate_kv(5 * block + block // 2)
    assert num_blocks == 5 and kv.num_blocks == 5 and _bytes(kv.keys + kv.values) == 5 * block
    assert plain.kv is own and plain.num_blocks == (1 << 20) // block  # the runner's own cache is untouched
    num_blocks, kv = graphed.allocate_kv(5 * block)
    assert num_blocks == 4 and kv.num_blocks == 5  # the last block is the decode graphs' scratch
    with pytest.raises(ValueError, match="holds no block"):
        plain.allocate_kv(block - 1)
    with pytest.raises(ValueError, match="holds no block"):
        graphed.allocate_kv(block)  # the scratch block alone


def test_capture_graphs_follows_the_resolved_mode(plain: ModelRunner, graphed: ModelRunner) -> None:
    assert plain.capture_graphs() is None and plain.graphs is None
    graphs = graphed.capture_graphs()
    assert isinstance(graphs, DecodeGraphs) and not graphs.capture_graphs  # eager: static buffers, no capture
    assert graphs.table_width == 64 // 16 and graphs.scratch_block == graphed.num_blocks
    assert isinstance(graphed.graphs, DecodeGraphs) and graphed.graphs is not graphs


def test_the_engine_adopts_the_resolved_config_and_the_kv_bytes(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    given = EngineConfig(max_num_seqs=8)
    engine = Engine(adapter, model, given)
    expected = dataclasses.replace(resolve_config(given, model, adapter.max_context), kv_cache_bytes=CPU_KV_CACHE_BYTES)
    assert engine.config == engine.runner.config == expected
    assert engine.max_model_len == adapter.max_context
