"""Choosing an attention backend (`auto` and explicit), its KV layout and block size, the settings' checks, and the
KV budget from GPU memory (the arithmetic; the measuring needs CUDA)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from services.common import config as config_lib
from services.common.config import ConfigError
from services.worker.config import WorkerConfig
from services.worker.engine.attention import Offers, choose_backend, default_block_size, make_backend
from services.worker.engine.attention.triton_backend import TritonBackend
from services.worker.engine.attention.triton_kernel import triton_varlen_attn
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.memory import MemoryProfile, kv_budget
from services.worker.engine.model_runner import resolve_graph_mode
from services.worker.engine.request import EngineRequest, SamplingOptions

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def test_auto_choice() -> None:
    assert choose_backend("auto", CPU, torch.float32, 16, 0) == "cpu-kernel"  # this machine has a C compiler
    assert choose_backend("auto", CPU, torch.float32, 16, 32) == "sdpa"  # the kernel is built for 16-token blocks
    assert choose_backend("auto", CPU, torch.bfloat16, 16, 0) == "cpu-kernel"
    assert choose_backend("auto", CPU, torch.float16, 16, 0) == "sdpa"
    assert choose_backend("auto", CPU, torch.float32, 24, 0) == "sdpa"
    assert choose_backend("sdpa", CUDA, torch.bfloat16, 128, 0) == "sdpa"
    assert [default_block_size(n) for n in ("flash", "flash-reference", "sdpa", "cpu-kernel", "triton")] == [
        256, 16, 16, 16, 16
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("paged_varlen_attn", "triton", "dtype", "block_size", "expected"),
    [(True, True, torch.bfloat16, 0, "flash"), (True, False, torch.float16, 512, "flash"),
     (False, True, torch.bfloat16, 0, "triton"), (False, True, torch.float16, 48, "triton"),
     (True, True, torch.bfloat16, 16, "triton"),  # flash's pages are multiples of 256
     (False, False, torch.bfloat16, 0, "sdpa"), (True, False, torch.bfloat16, 16, "sdpa"),
     (False, True, torch.bfloat16, 24, "sdpa"),  # not a multiple of 16
     (True, True, torch.float32, 0, "sdpa")],  # both kernels' auto choice is 16-bit only
)  # fmt: skip
def test_auto_choice_on_cuda_follows_what_torch_and_triton_offer(
    paged_varlen_attn: bool, triton: bool, dtype: torch.dtype, block_size: int, expected: str
) -> None:
    """flash where torch's varlen_attn takes a block table, else triton where Triton imports, else sdpa."""
    offers = Offers(paged_varlen_attn=paged_varlen_attn, triton=triton)
    assert choose_backend("auto", CUDA, dtype, 128, block_size, offers) == expected
    # what this process has: torch 2.13's varlen_attn takes a block table, and the dev extra installs Triton
    assert Offers.here() == Offers(paged_varlen_attn=True, triton=True)


def test_published_backend_is_the_one_that_ran(loaded: tuple[Any, Any], caplog: pytest.LogCaptureFixture) -> None:
    """The engine publishes (kv_state, config, the start-up log) the backend whose kernel computed its steps."""
    adapter, model = loaded
    with caplog.at_level(logging.INFO, logger="services.worker.engine.model_runner"):
        engine = Engine(adapter, model, EngineConfig(kv_cache_bytes=2 << 20, attention_backend="triton"))
    backend = engine.runner.backend
    calls = []
    kernel = backend.attention
    backend.attention = lambda *args, **kwargs: calls.append(args[0].shape[0]) or kernel(*args, **kwargs)
    engine.add_request(EngineRequest("r", [1, 2, 3, 4, 5], [], SamplingOptions(max_tokens=2, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    assert isinstance(backend, TritonBackend) and kernel is triton_varlen_attn
    assert calls == [5, 5, 1, 1]  # two layers a step: the prompt, then one decode (the last token needs no step)
    assert engine.kv_state().attention_backend == engine.config.attention_backend == "triton"
    assert any("attention backend triton on cpu" in r.getMessage() for r in caplog.records)


def test_explicit_backends_refuse_where_they_cannot_run() -> None:
    with pytest.raises(ValueError, match="needs CUDA, float16 or bfloat16"):
        make_backend("flash", 256, CPU, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="multiple of 256, got 16"):
        make_backend("flash", 16, CUDA, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16 on the CPU, 16-token blocks"):
        make_backend("cpu-kernel", 32, CPU, torch.float32, 16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("paged", 16, CPU, torch.float32, 16)
    assert make_backend("flash-reference", 48, CPU, torch.float32, 16).block_size == 48


@pytest.mark.parametrize(
    ("backend", "block_size", "key_shape"),
    [("flash-reference", 0, "blocks,16,2,16"), ("flash-reference", 256, "blocks,256,2,16"),
     ("sdpa", 0, "2,blocks,16,16"), ("cpu-kernel", 0, "2,blocks,16,16")],
)  # fmt: skip
def test_engine_resolves_backend_layout_and_publishes_it(
    loaded: tuple[Any, Any], backend: str, block_size: int, key_shape: str
) -> None:
    adapter, model = loaded
    engine = Engine(
        adapter, model, EngineConfig(kv_cache_bytes=2 << 20, attention_backend=backend, block_size=block_size)
    )
    runner = engine.runner
    expected = tuple(runner.num_blocks if d == "blocks" else int(d) for d in key_shape.split(","))
    if backend == "cpu-kernel":  # keys dim-major inside a block
        expected = (expected[0], expected[1], expected[3], expected[2])
    assert tuple(runner.kv.keys[0].shape) == expected and len(runner.kv.keys) == runner.shape.num_layers
    state = engine.kv_state()
    assert state.attention_backend == backend and state.block_size == (block_size or 16)
    assert engine.config.kv_cache_bytes == 2 << 20 and engine.config.cuda_graphs == "off"


def test_cpu_defaults_and_warm_up(loaded: tuple[Any, Any]) -> None:
    """KV bytes 0 means 256 MiB off CUDA; the warm-up forward that sizes KV on CUDA runs here too."""
    adapter, model = loaded
    engine = Engine(adapter, model, EngineConfig())
    assert engine.config.kv_cache_bytes == 256 << 20 and engine.config.attention_backend == "cpu-kernel"
    engine.runner.warm_up(300, 8)


def test_settings_are_checked() -> None:
    for bad in ({"attention_backend": "fast"}, {"cuda_graphs": "yes"}, {"gpu_memory_utilization": 0.0},
                {"gpu_memory_utilization": 1.5}, {"block_size": -1}, {"kv_cache_bytes": -5}):  # fmt: skip
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    env = {"EPD_MODEL": "/m", "EPD_GPU_MEMORY_UTILIZATION": "1.2"}
    with pytest.raises(ConfigError, match="EPD_GPU_MEMORY_UTILIZATION"):
        config_lib.load(WorkerConfig, env=env)
    with pytest.raises(ConfigError, match="EPD_ATTENTION_BACKEND"):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_ATTENTION_BACKEND": "fast"})
    worker = config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_CUDA_GRAPHS": "false"})
    assert (worker.block_size, worker.kv_cache_bytes, worker.cuda_graphs) == (0, 0, "off")  # false: off
    assert config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_CUDA_GRAPHS": "eager"}).cuda_graphs == "eager"
    with pytest.raises(ConfigError, match="EPD_CUDA_GRAPHS must be one of auto, on, off, eager"):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_CUDA_GRAPHS": "yes"})


def test_every_engine_setting_is_a_worker_flag_and_variable_with_the_same_default() -> None:
    """The engine's settings are declared once: each EngineConfig field is a worker flag and EPD_* variable
    with the engine's default, and the worker hands the engine exactly what it read."""
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser()
    config_lib.add_arguments(parser, WorkerConfig)
    flags = {action.dest: action.option_strings for action in parser._actions}
    worker_defaults = WorkerConfig()
    engine_defaults = EngineConfig()
    env = {"EPD_MODEL": "/m"}
    for field in dataclasses.fields(EngineConfig):
        assert flags[field.name] == [config_lib.flag_name(field.name)], field.name
        if field.name == "dtype":  # a service's default is auto (the folder's, resolved at load); an engine's float32
            assert (worker_defaults.dtype, engine_defaults.dtype) == ("auto", "float32")
            continue
        assert getattr(worker_defaults, field.name) == getattr(engine_defaults, field.name), field.name
        assert field.metadata.get("help"), f"{field.name} has no help text"
        if field.type in ("int", "float") or field.type.startswith("int |"):
            env[config_lib.env_name(field.name)] = "7" if field.name != "gpu_memory_utilization" else "0.5"
    worker = config_lib.load(WorkerConfig, env=env)
    engine = worker.engine_config()
    assert dataclasses.asdict(engine) == {f.name: getattr(worker, f.name) for f in dataclasses.fields(EngineConfig)}
    assert engine.max_num_seqs == 7 and engine.max_model_len == 7 and engine.gpu_memory_utilization == 0.5


def test_kv_budget_from_memory() -> None:
    gib = 1 << 30
    profile = MemoryProfile(total=80 * gib, peak=20 * gib, other=1 * gib)
    assert kv_budget(profile, 0.9, gib // 4) == int(72 * gib) - 21 * gib - gib // 4
    with pytest.raises(ValueError, match="raise EPD_GPU_MEMORY_UTILIZATION"):
        kv_budget(profile, 0.25, 0)


def test_graph_modes() -> None:
    """auto captures only with the real kernels (flash, triton) on CUDA; on captures flash-reference too (checks);
    eager anywhere."""
    assert resolve_graph_mode("auto", CUDA, "flash", "default") == "auto"
    assert resolve_graph_mode("auto", CUDA, "triton", "default") == "auto"  # reads only each row's blocks
    assert resolve_graph_mode("eager", CPU, "triton", "default") == "eager"
    assert resolve_graph_mode("auto", CUDA, "flash-reference", "default") == "off"  # pads rows to max_model_len
    assert resolve_graph_mode("auto", CPU, "flash-reference", "default") == "off"
    assert resolve_graph_mode("on", CUDA, "flash-reference", "default") == "on"
    assert resolve_graph_mode("eager", CPU, "flash-reference", "default") == "eager"
    assert resolve_graph_mode("auto", CUDA, "flash", "dynamic") == "off"  # branches on position values
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_graph_mode("on", CPU, "flash-reference", "default")
    with pytest.raises(ValueError, match="varlen attention backend"):
        resolve_graph_mode("eager", CPU, "sdpa", "default")


@pytest.mark.parametrize("context_len", [1023, 1024, 1025])
def test_a_short_chunk_in_the_kernels_form_has_a_length_per_row_at_any_context(context_len: int) -> None:
    """cpu-kernel lays a short chunk after a cached context out as one decode row per token, the last row's
    context its whole context, also where that length is exactly the backend's reused arange (1,024)."""
    from types import SimpleNamespace

    from services.worker.engine.attention.cpu_kernel import CpuKernelBackend
    from services.worker.engine.attention.gathered_layout import ChunkRows, GatheredLayout

    size, rows = 16, 8
    blocks = -(-context_len // size)
    backend = CpuKernelBackend(size, torch.device("cpu"), torch.float32, kernel=None, fresh_chunks=True)  # type: ignore[arg-type]
    layout = GatheredLayout(chunks=[ChunkRows(0, rows, context_len, 2 * rows, blocks)])
    packed = torch.arange(2 * rows + blocks, dtype=torch.int64)
    kv = SimpleNamespace(keys=[torch.zeros(1, blocks, 64, size)], layout="head-major")
    [chunk] = backend.context(SimpleNamespace(layout=layout, num_tokens=rows), packed, kv).chunks  # type: ignore[arg-type]
    assert chunk.lengths is not None and chunk.lengths.tolist() == list(range(context_len - rows + 1, context_len + 1))
    assert chunk.block_ids.tolist() == list(range(2 * rows, 2 * rows + blocks)) * rows


def test_a_fresh_chunk_goes_through_the_kernel_only_with_cpu_kernel_in_bfloat16() -> None:
    """A chunk with nothing cached before it: cpu-kernel in bfloat16, where the kernel measured faster, lays it out
    as one decode row per token over the chunk's own blocks (row r over its first r + 1 tokens); in float32, where
    SDPA measured faster, and with sdpa, it stays one plain causal call over the chunk's K/V."""
    from types import SimpleNamespace

    from services.worker.engine.attention.cpu_kernel import CpuKernelBackend
    from services.worker.engine.attention.gathered_layout import ChunkRows, GatheredLayout
    from services.worker.engine.attention.sdpa import SdpaBackend

    size, rows = 16, 40
    blocks = -(-rows // size)
    layout = GatheredLayout(chunks=[ChunkRows(0, rows, rows, 2 * rows, blocks)])
    packed = torch.arange(2 * rows + blocks, dtype=torch.int64)
    kv = SimpleNamespace(keys=[torch.zeros(1, blocks, 64, size)], layout="head-major")
    step = SimpleNamespace(layout=layout, num_tokens=rows)
    kernel = CpuKernelBackend(size, CPU, torch.bfloat16, kernel=None, fresh_chunks=True)  # type: ignore[arg-type]
    [chunk] = kernel.context(step, packed, kv).chunks  # type: ignore[arg-type]
    assert chunk.lengths is not None and chunk.lengths.tolist() == list(range(1, rows + 1))
    assert chunk.block_ids.tolist() == list(range(2 * rows, 2 * rows + blocks)) * rows
    for backend in (
        CpuKernelBackend(size, CPU, torch.float32, kernel=None, fresh_chunks=True),  # type: ignore[arg-type]
        CpuKernelBackend(size, CPU, torch.bfloat16, kernel=None, fresh_chunks=False),  # type: ignore[arg-type]
        SdpaBackend(size, CPU, torch.float32),
    ):
        [plain] = backend.context(step, packed, kv).chunks  # type: ignore[arg-type]
        assert plain.lengths is None and plain.block_ids is None and plain.mask is None
