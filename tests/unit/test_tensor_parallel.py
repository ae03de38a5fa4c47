"""Tensor parallelism on the CPU with gloo and real rank processes: a TP=2 engine's logits equal TP=1's within
1e-4 over a prefill and 32 decode steps (Qwen2-VL, Qwen2.5-VL, LLaVA; a config whose heads, MLP and vocabulary
split unevenly; one with fewer KV heads than ranks, replicated), its greedy output for 16 concurrent mixed
text/image requests equals transformers' `generate` for each alone, closing it ends its ranks, and a size that
cannot split a model is refused before any process starts.

Each model's TP=2 ranks start once for the module (`tp2`) and every case runs on a fresh engine over that
runner (`engine_over`): a token budget or prefix caching is the scheduler's and block manager's business on rank
0, and the other ranks only run the steps they are sent, so the cases differ where they did when each started
its own ranks, in the steps sent."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from services.models.registry import load_adapter
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingOptions
from tests.engine_support import (
    Prompt,
    Result,
    backend_config,
    build_prompt,
    collect,
    drain,
    image,
    mixed_workload,
    reference,
    run_workload,
)
from tests.tp_support import record_logits, tiny_variant

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(
    tiny_model_dir: Path, tiny_model_dir_25: Path, tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-variants")
    return {
        "qwen2-vl": tiny_model_dir,
        "qwen2.5-vl": tiny_model_dir_25,
        "llava": tiny_llava_dir,
        # 6 query heads over 3 KV heads split 4+2 / 2+1, an MLP of 129 columns, 563 vocabulary rows
        "uneven": tiny_variant(
            tiny_model_dir,
            root / "uneven",
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            intermediate_size=129,
            vocab_size=563,
        ),  # fmt: skip
        # one KV head, on both ranks; each rank 2 of its 4 query heads
        "replicated": tiny_variant(tiny_model_dir, root / "replicated", num_key_value_heads=1),
    }


STARTED = backend_config("kernel", 2048, True)
"""The settings the TP=2 engines start with (the CPU decode kernel, 16-token blocks, 16 MiB of KV a rank);
the cases change only the budget and prefix caching (`engine_over`)."""


class Started:
    """Each model's TP=2 engine, started on first use and kept for the module; ``close`` ends them all."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders
        self.engines: dict[str, Engine] = {}

    def __getitem__(self, name: str) -> Engine:
        if name not in self.engines:
            adapter = load_adapter(self.folders[name])
            config = dataclasses.replace(STARTED, tensor_parallel_size=2)
            self.engines[name] = Engine(adapter, adapter.load_model(), config)  # TP cuts the model to rank 0's shard
        return self.engines[name]

    def close(self) -> list[Any]:
        """Close every engine's ranks, the engines side by side (each waits for its ranks to exit); the rank
        processes that were running."""
        processes = [p for engine in self.engines.values() for p in engine.runner.ranks.processes]
        with ThreadPoolExecutor(max(1, len(self.engines))) as pool:
            list(pool.map(lambda engine: engine.runner.close(), self.engines.values()))
        self.engines.clear()
        return processes


@pytest.fixture(scope="module")
def tp2(folders: dict[str, Path]) -> Iterator[Started]:
    started = Started(folders)
    try:
        yield started
    finally:
        started.close()


def engine_over(started: Engine, budget: int, caching: bool, max_num_seqs: int = 16) -> Engine:
    """A fresh engine (scheduler, block manager, embeddings: nothing cached, every block free) over
    ``started``'s runner and ranks, with ``budget`` tokens a step and prefix caching ``caching``."""
    runner = started.runner
    runner.config = dataclasses.replace(
        runner.config, max_num_batched_tokens=budget, enable_prefix_caching=caching, max_num_seqs=max_num_seqs
    )
    with mock.patch("services.worker.engine.engine.make_runner", return_value=runner):
        return Engine(started.adapter, runner.model, runner.config)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "llava", "uneven", "replicated"])
def test_tp2_logits_equal_tp1_over_a_prefill_and_32_decodes(folders: dict[str, Path], tp2: Started, name: str) -> None:
    folder = folders[name]
    adapter = load_adapter(folder)
    whole = adapter.load_model()
    prompts = [
        build_prompt(adapter, whole, ["describe the picture", image(56, 84, 7), "in a few words"]),
        build_prompt(adapter, whole, ["count the letters of the alphabet, one by one"]),
    ]
    engines = {1: Engine(adapter, adapter.load_model(), dataclasses.replace(STARTED, max_num_seqs=64)),
               2: engine_over(tp2[name], 2048, True, max_num_seqs=64)}  # fmt: skip
    logits: dict[int, list[torch.Tensor]] = {}
    tokens: dict[int, dict[str, Any]] = {}
    for size, engine in engines.items():
        assert engine.vocab_size == whole.get_output_embeddings().out_features
        logits[size] = record_logits(engine)
        try:
            for i, prompt in enumerate(prompts):
                for mm_hash, tensor in prompt.embeddings.items():
                    engine.provide_embedding(mm_hash, tensor)
                engine.add_request(prompt.request(f"r{i}", SamplingOptions(max_tokens=33, ignore_eos=True)))
            tokens[size] = {}
            drain(engine, tokens[size])
        finally:
            del engine.runner.run  # the shared runner's own run again
    ranks = engines[2].runner.ranks.processes
    assert len(ranks) == 1 and ranks[0].is_alive()
    assert len(logits[1]) == len(logits[2]) == 33  # one prefill step, then 32 decode steps of both requests
    for step, (one, two) in enumerate(zip(logits[1], logits[2], strict=True)):
        assert one.shape == two.shape == (2, whole.get_output_embeddings().out_features)
        assert (one - two).abs().max().item() < 1e-4, f"step {step}"
    assert {k: r.tokens for k, r in tokens[1].items()} == {k: r.tokens for k, r in tokens[2].items()}


def test_tp2_kv_blocks_hold_half_the_heads(folders: dict[str, Path], tp2: Started) -> None:
    """Each rank holds its KV heads only: at the same per-rank budget TP=2 has twice TP=1's blocks (2 of 4 KV
    heads each), and with one KV head replicated the same count."""
    counts = {}
    for name in ("qwen2-vl", "replicated"):
        adapter = load_adapter(folders[name])
        counts[name, 1] = Engine(adapter, adapter.load_model(), STARTED).kv_state().total_blocks
        counts[name, 2] = tp2[name].kv_state().total_blocks
    assert counts["qwen2-vl", 2] == 2 * counts["qwen2-vl", 1]
    assert counts["replicated", 2] == counts["replicated", 1]


def test_a_size_that_cannot_split_the_model_is_refused_before_any_rank_starts(tiny_model_dir: Path) -> None:
    adapter = load_adapter(tiny_model_dir)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide over the model's 2 KV heads"):
        Engine(adapter, adapter.load_model(), EngineConfig(tensor_parallel_size=3))
    assert set(multiprocessing.active_children()) == before  # the module's started ranks aside, none new


@pytest.fixture(scope="module")
def workloads(folders: dict[str, Path]) -> dict[str, list[tuple[Prompt, int, list[int]]]]:
    out = {}
    for name in ("qwen2-vl", "qwen2.5-vl", "llava", "replicated"):
        adapter = load_adapter(folders[name])
        out[name] = mixed_workload(adapter, adapter.load_model(), folders[name])
    return out


CASES = [("qwen2-vl", budget, caching) for budget in (16, 512) for caching in (True, False)]
CASES += [("qwen2.5-vl", 16, True), ("qwen2.5-vl", 512, False), ("llava", 16, False), ("llava", 512, True)]
CASES += [("replicated", 16, True)]


@pytest.mark.parametrize(
    ("name", "budget", "caching"), CASES, ids=[f"{n}-{b}-{'cache' if c else 'nocache'}" for n, b, c in CASES]
)
def test_tp2_concurrent_greedy_equals_generate(
    tp2: Started, workloads: dict[str, Any], name: str, budget: int, caching: bool
) -> None:
    """16 concurrent requests, text and one to three images, arrivals and embeddings staggered (the exactness
    tests' workload), through a TP=2 engine with the CPU decode kernel."""
    results = run_workload(engine_over(tp2[name], budget, caching), workloads[name])
    if caching:
        assert any(r.cached_tokens > 0 for r in results.values())


def test_tp2_exact_repeat_copies_its_last_block_on_every_rank(
    tp2: Started, folders: dict[str, Path], workloads: dict[str, Any]
) -> None:
    """A repeat of a prompt while the first still decodes: its last partial block is copied from the first's on
    both ranks (the step message carries the pair), one token is computed, and both equal `generate`."""
    prompt, _, _ = workloads["qwen2-vl"][3]  # an image and text
    assert len(prompt.token_ids) % 16 > 1  # its last block partial: more than the one token to compute in it
    engine = engine_over(tp2["qwen2-vl"], 64, True)
    for mm_hash, tensor in prompt.embeddings.items():
        engine.provide_embedding(mm_hash, tensor)
    sampling = SamplingOptions(max_tokens=8)
    engine.add_request(prompt.request("first", sampling))
    results: dict[str, Result] = {}
    while len(results.get("first", Result()).tokens) < 2:
        collect(engine.step(), results)
    engine.add_request(prompt.request("again", sampling))
    drain(engine, results)
    assert results["again"].cached_tokens == len(prompt.token_ids) - 1
    expected = reference(folders["qwen2-vl"], prompt, 8)
    assert results["first"].tokens == results["again"].tokens == expected


def test_closing_an_engine_ends_its_ranks(tp2: Started) -> None:
    """Last here: every started engine closed, each rank process has exited."""
    tp2["qwen2-vl"]  # started already unless this test runs alone
    processes = tp2.close()
    assert processes and not any(p.is_alive() for p in processes)
