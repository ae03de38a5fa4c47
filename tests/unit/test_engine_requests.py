"""Engine behaviour on the tiny model: prefix cache reuse, aborts returning everything, seeded
sampling independent of the batch, and the API's edges."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models.media_span import MediaSpan
from services.worker.engine.attention.kv_cache import KVShape
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.reservation import NeverFits
from tests.engine_support import Prompt, Result, build_prompt, collect, drain, image, reference

LONG = "a long shared system preamble about many things that every request starts with " * 4
GREEDY = SamplingOptions(max_tokens=12)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(loaded: tuple[Any, Any], **overrides: Any) -> Engine:
    adapter, model = loaded
    settings = {"kv_cache_bytes": 8 << 20, "max_num_batched_tokens": 64, "max_num_seqs": 16, **overrides}
    return Engine(adapter, model, EngineConfig(**settings))


def run_one(engine: Engine, prompt: Prompt, request_id: str, salt: str = "") -> Result:
    for mm_hash, tensor in prompt.embeddings.items():
        engine.provide_embedding(mm_hash, tensor)
    engine.add_request(prompt.request(request_id, GREEDY, salt))
    results: dict[str, Result] = {}
    drain(engine, results)
    return results[request_id]


def test_prefix_cache_reuse_and_isolation(loaded: tuple[Any, Any], tiny_model_dir: Path) -> None:
    adapter, model = loaded
    cat, dog = image(448, 448, 11), image(448, 448, 12)
    first = build_prompt(adapter, model, [LONG, cat, "what is shown here?"])
    second = build_prompt(adapter, model, [LONG, cat, "describe the colours"])
    other_image = build_prompt(adapter, model, [LONG, dog, "what is shown here?"])
    engine = make_engine(loaded)
    assert run_one(engine, first, "a").cached_tokens == 0
    reused = run_one(engine, second, "b")
    image_end = first.media[0].offset + first.media[0].num_tokens
    assert reused.cached_tokens >= image_end - 16  # the text and the whole image came from the cache
    assert reused.tokens == reference(tiny_model_dir, second, GREEDY.max_tokens)
    swapped = run_one(engine, other_image, "c")
    assert 0 < swapped.cached_tokens <= first.media[0].offset  # nothing from the image on
    assert swapped.tokens == reference(tiny_model_dir, other_image, GREEDY.max_tokens)
    assert run_one(engine, first, "d", salt="tenant-2").cached_tokens == 0
    assert run_one(engine, first, "e").cached_tokens > 0


def test_a_prefix_hits_last_chunk_goes_through_the_decode_kernel_and_equals_generate(
    loaded: tuple[Any, Any], tiny_model_dir: Path
) -> None:
    """The uncached tail of a prefix-cache hit (under a block after the image) runs as kernel rows, one per
    token, each over its own context length, and the tokens still equal `generate`'s."""
    adapter, model = loaded
    prompt = build_prompt(adapter, model, [LONG, image(448, 448, 13), "what is shown here, and why?"])  # 6 past a block
    engine = make_engine(loaded, attention_backend="cpu-kernel")
    run_one(engine, prompt, "first")
    kernel = engine.runner.backend.decode_kernel
    chunks: list[list[int]] = []  # each call's context lengths where it had several rows

    def spy(q, keys, values, tables, lengths, scale):  # noqa: ANN001, ANN202
        if lengths.numel() > 1:
            chunks.append(lengths.tolist())
        return kernel(q, keys, values, tables, lengths, scale)

    engine.runner.backend.decode_kernel = spy
    engine.scheduler.block_manager.tail_to_block.clear()  # as if its last block had been evicted: it is computed
    hit = run_one(engine, prompt, "again")
    tail = len(prompt.token_ids) - hit.cached_tokens
    assert 1 < tail <= engine.config.block_size
    assert chunks and all(c == list(range(hit.cached_tokens + 1, hit.cached_tokens + tail + 1)) for c in chunks)
    assert hit.tokens == reference(tiny_model_dir, prompt, GREEDY.max_tokens)


def test_an_exact_repeat_copies_its_prompts_last_block_and_equals_generate(
    loaded: tuple[Any, Any], tiny_model_dir: Path
) -> None:
    """A repeat of a computed prompt takes its full blocks and its partial last block from the cache, the partial
    one copied into a block of its own (the first request still holds and writes the source): one token computed,
    and both requests' tokens equal `generate`'s."""
    adapter, model = loaded
    prompt = build_prompt(adapter, model, [LONG, image(448, 448, 14), "what is shown here, and why?"])
    assert len(prompt.token_ids) % 16 > 1
    engine = make_engine(loaded)
    for mm_hash, tensor in prompt.embeddings.items():
        engine.provide_embedding(mm_hash, tensor)
    engine.add_request(prompt.request("first", GREEDY))
    results: dict[str, Result] = {}
    while len(results.get("first", Result()).tokens) < 3:
        collect(engine.step(), results)
    engine.add_request(prompt.request("again", GREEDY))
    collect(engine.step(), results)
    assert [c.num_tokens for c in engine.runner.last_chunks if c.seq.request_id == "again"] == [1]
    drain(engine, results)
    assert results["again"].cached_tokens == len(prompt.token_ids) - 1
    expected = reference(tiny_model_dir, prompt, GREEDY.max_tokens)
    assert results["first"].tokens == expected
    assert results["again"].tokens == expected
    state = engine.kv_state()
    assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0
    assert engine.embedding_stats().pinned == 0


def test_half_aborted_at_random_points_return_everything(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    rng = random.Random(7)
    pictures = [image(224, 224, 20 + i) for i in range(4)]
    prompts = [
        build_prompt(adapter, model, [f"request {i} " * (1 + i % 5)] + ([pictures[i % 4], "what?"] if i % 2 else []))
        for i in range(32)
    ]
    engine = make_engine(loaded, max_num_batched_tokens=48, max_num_seqs=12)
    aborted = set(rng.sample(range(32), 16))
    abort_at = {i: rng.randint(0, 40) for i in aborted}
    results: dict[str, Result] = {}
    for i, prompt in enumerate(prompts):
        sampling = SamplingOptions(max_tokens=rng.randint(4, 20), ignore_eos=True)
        engine.add_request(prompt.request(f"r{i}", sampling))
    for step in range(10_000):
        if step == 3 or step == 15:  # embeddings arrive late; some requests are aborted before they do
            for prompt in prompts[step % 2 :: 2]:
                for mm_hash, tensor in prompt.embeddings.items():
                    engine.provide_embedding(mm_hash, tensor)
        for i in [i for i, at in abort_at.items() if at == step]:
            assert engine.abort(f"r{i}") == (results.get(f"r{i}", Result()).finish_reason is None)
        if step > 40 and not engine.has_work():
            break
        collect(engine.step(), results)
    finished = {int(rid[1:]) for rid, r in results.items() if r.finish_reason == "length"}
    assert set(range(32)) - aborted <= finished
    state = engine.kv_state()
    assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0
    assert state.running == 0 and state.waiting == 0
    assert engine.embedding_stats().pinned == 0 and not engine.embeddings.refs


def test_seeded_sample_is_the_same_alone_and_in_a_batch(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    target = build_prompt(adapter, model, ["tell me a story about", image(120, 90, 30), "this picture"])
    seeded = SamplingOptions(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine(loaded)
    alone_result = run_one_sampled(alone, [(target, seeded)])["t"]
    batch = [(build_prompt(adapter, model, [f"other prompt {i} " * (i + 1)]), other_sampling(i)) for i in range(16)]
    crowd = make_engine(loaded, max_num_batched_tokens=32)
    crowd_result = run_one_sampled(crowd, [*batch[:8], (target, seeded), *batch[8:]])["t"]
    assert crowd_result.tokens == alone_result.tokens and len(alone_result.tokens) == 24


def other_sampling(i: int) -> SamplingOptions:
    if i % 3 == 0:
        return SamplingOptions(max_tokens=20)
    return SamplingOptions(max_tokens=20, temperature=0.8, seed=i if i % 3 == 1 else None)


def run_one_sampled(engine: Engine, work: list[tuple[Prompt, SamplingOptions]]) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for i, (prompt, sampling) in enumerate(work):
        for mm_hash, tensor in prompt.embeddings.items():
            engine.provide_embedding(mm_hash, tensor)
        rid = "t" if sampling.seed == 1234 else f"o{i}"
        engine.add_request(prompt.request(rid, sampling))
        if i % 3 == 2:
            collect(engine.step(), results)
    drain(engine, results)
    return results


def test_admit_reserves_all_or_nothing_and_abort_gives_back(loaded: tuple[Any, Any]) -> None:
    engine = make_engine(loaded, kv_cache_bytes=64 * 8192)  # 64 blocks of 16 tokens
    state = engine.kv_state()
    assert state.total_blocks == 64 and state.block_size == 16
    big = SamplingOptions(max_tokens=40 * 16 - 3)
    assert engine.admit(EngineRequest("x", [1, 2, 3], sampling=big)) and engine.kv_state().reserved_blocks == 40
    assert not engine.admit(EngineRequest("y", [1, 2, 3], sampling=SamplingOptions(max_tokens=30 * 16 - 3)))
    assert "y" not in engine.requests and engine.kv_state().reserved_blocks == 40  # refused: nothing kept
    assert not engine.admit(EngineRequest("x", [1, 2, 3], sampling=big))  # the id is live
    with pytest.raises(NeverFits, match="needs 65 KV blocks"):  # more than the worker could ever reserve
        engine.admit(EngineRequest("huge", [1, 2, 3], sampling=SamplingOptions(max_tokens=64 * 16)))
    assert engine.abort("x") and not engine.abort("x")
    assert engine.kv_state().reserved_blocks == 0
    assert engine.admit(EngineRequest("z", [1, 2, 3], sampling=SamplingOptions(max_tokens=5)))
    assert engine.kv_state().reserved_blocks == 1
    assert engine.abort("z") and engine.kv_state().reserved_blocks == 0


def test_embedding_before_and_after_and_missing(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    prompt = build_prompt(adapter, model, ["look", image(56, 56, 40), "and", image(112, 56, 41)])
    engine = make_engine(loaded)
    first, second = prompt.media
    engine.provide_embedding(first.mm_hash, prompt.embeddings[first.mm_hash])  # before the request
    assert engine.embedding_stats().buffered == 1
    engine.add_request(prompt.request("r", GREEDY))
    assert engine.missing_embeddings("r") == [second.mm_hash]
    assert engine.embedding_stats().pinned == 1 and engine.embedding_stats().buffered == 0
    results: dict[str, Result] = {}
    for _ in range(3):
        collect(engine.step(), results)
    assert engine.has_work() is False and "r" not in results  # text before the second image is done
    engine.provide_embedding(second.mm_hash, prompt.embeddings[second.mm_hash])
    drain(engine, results)
    assert results["r"].finish_reason is not None and engine.embedding_stats().pinned == 0
    assert engine.missing_embeddings("r") == []


def test_bad_requests_are_refused_and_leave_nothing(loaded: tuple[Any, Any]) -> None:
    adapter, model = loaded
    engine = make_engine(loaded, kv_cache_bytes=8 * 8192)
    prompt = build_prompt(adapter, model, ["x", image(56, 56, 50)])
    item = prompt.media[0]
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(EngineRequest("big", [1] * 100, sampling=SamplingOptions(max_tokens=100)))
    with pytest.raises(ValueError, match="image item at .* covers other tokens"):
        moved = MediaSpan(item.mm_hash, item.offset - 1, item.num_tokens, item.grid_thw)
        engine.add_request(EngineRequest("moved", prompt.token_ids, [moved], GREEDY))
    with pytest.raises(ValueError):
        engine.add_request(EngineRequest("nomedia", prompt.token_ids, [], GREEDY))
    engine.add_request(prompt.request("ok", GREEDY))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(prompt.request("ok", GREEDY))
    with pytest.raises(ValueError, match="rows"):
        engine.provide_embedding(item.mm_hash, torch.zeros(item.num_tokens + 1, 64))
    assert set(engine.requests) == {"ok"} and engine.embeddings.refs == {item.mm_hash: 1}


def test_request_waits_for_reserved_blocks_without_spinning(loaded: tuple[Any, Any]) -> None:
    """Every block is promised to an admitted request still waiting for its image's embedding: a request
    added then can neither run nor reserve, and the engine reports no work instead of spinning; when the
    embedding comes, both run to the end."""
    adapter, model = loaded
    prompt = build_prompt(adapter, model, ["x", image(56, 56, 60)])
    engine = make_engine(loaded, kv_cache_bytes=8 * 8192)  # 8 blocks
    fill = SamplingOptions(max_tokens=8 * 16 - len(prompt.token_ids), ignore_eos=True)
    assert engine.admit(prompt.request("held", fill)) and engine.kv_state().reserved_blocks == 8
    engine.add_request(EngineRequest("late", [1, 2, 3], sampling=SamplingOptions(max_tokens=5, ignore_eos=True)))
    results: dict[str, Result] = {}
    for _ in range(10):  # "held" computes its text up to the image, then nothing can run
        if not engine.has_work():
            break
        collect(engine.step(), results)
    assert not engine.has_work() and engine.step() == [] and results == {}
    item = prompt.media[0]
    engine.provide_embedding(item.mm_hash, prompt.embeddings[item.mm_hash])
    drain(engine, results)
    assert results["late"].finish_reason == "length" and len(results["late"].tokens) == 5
    assert results["held"].finish_reason == "length"


def test_kv_state_counts_preemptions(loaded: tuple[Any, Any]) -> None:
    """Overcommitted (3x a 12-block KV), requests preempt each other by recompute, the published state counts
    it and the tokens equal a roomy engine's; at overcommit 1.0 the count stays 0."""
    adapter, model = loaded
    block_bytes = KVShape.of(model).block_bytes(16, torch.float32)
    prompts = [build_prompt(adapter, model, [f"request {i} " + "words " * (8 + 3 * i)]) for i in range(6)]
    outputs = []
    for overcommit, blocks in ((1.0, 256), (3.0, 12)):
        engine = make_engine(loaded, kv_cache_bytes=blocks * block_bytes, overcommit=overcommit)
        assert engine.kv_state().total_blocks == blocks
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt.request(f"r{i}", SamplingOptions(max_tokens=20, ignore_eos=True)))
        results: dict[str, Result] = {}
        drain(engine, results)
        outputs.append([results[f"r{i}"].tokens for i in range(len(prompts))])
        state = engine.kv_state()
        assert (state.preemptions > 0) == (overcommit > 1), state
        assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0
    assert outputs[0] == outputs[1]


def test_prefix_cache_with_256_token_blocks(loaded: tuple[Any, Any], tiny_model_dir: Path) -> None:
    """The flash backend's block size, through flash-reference and the decode graphs' padded path: a shared prefix
    is reused in whole 256-token blocks (the image's included), and the answer still equals `generate`."""
    adapter, model = loaded
    picture = image(448, 448, 61)
    first = build_prompt(adapter, model, [LONG, picture, "what is shown here?"])
    second = build_prompt(adapter, model, [LONG, picture, "describe the colours"])
    common = next(i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=False)) if a != b)
    assert common > 256 + 1 and first.media[0].offset < 256 < first.media[0].offset + first.media[0].num_tokens
    engine = make_engine(loaded, attention_backend="flash-reference", block_size=256, cuda_graphs="eager",
                         max_model_len=2048)  # fmt: skip
    assert run_one(engine, first, "a").cached_tokens == 0
    reused = run_one(engine, second, "b")
    assert reused.cached_tokens == common // 256 * 256
    assert reused.tokens == reference(tiny_model_dir, second, GREEDY.max_tokens)
    assert run_one(engine, first, "c", salt="tenant-2").cached_tokens == 0
