"""The decode-graph machinery on the CPU, run eagerly (no capture): buckets, padding, scratch block, static buffers.

A padded decode step gives the real rows the logits of the same step unpadded, writes K/V only to its own
sequences' slots and the scratch block, and keeps one packed layout per bucket (what a graph reads).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.models.media_span import MediaSpan
from services.worker.engine.config import EngineConfig
from services.worker.engine.cuda_graphs import graph_buckets
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.sequence import Sequence
from tests.engine_support import Result, build_prompt, collect, drain, image

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def graph_engine(loaded: tuple[Any, Any], **overrides: Any) -> Engine:
    adapter, model = loaded
    settings = {"kv_cache_bytes": 4 << 20, "attention_backend": "flash-reference", "cuda_graphs": "eager",
                "max_num_seqs": 12, "max_model_len": 512, "max_num_batched_tokens": 256, **overrides}  # fmt: skip
    return Engine(adapter, model, EngineConfig(**settings))


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]


def test_only_one_token_text_rows_take_a_bucket(loaded: tuple[Any, Any]) -> None:
    graphs = graph_engine(loaded).runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8, 12]

    def chunk(num_tokens: int, start: int = 5, media: tuple[MediaSpan, ...] = ()) -> ScheduledChunk:
        seq = Sequence(EngineRequest("s", list(range(20)), list(media), SamplingOptions()), 16, False)
        return ScheduledChunk(seq, start, num_tokens, True)

    assert graphs.bucket_for([chunk(1)] * 3) == 4
    assert graphs.bucket_for([chunk(1)] * 12) == 12
    assert graphs.bucket_for([chunk(1)] * 13) is None  # more rows than the largest bucket
    assert graphs.bucket_for([chunk(1), chunk(2)]) is None  # a chunk: eager
    assert graphs.bucket_for([]) is None
    item = MediaSpan("m", 4, 3)
    assert graphs.bucket_for([chunk(1, 5, (item,))]) is None  # its token is an image row
    assert graphs.bucket_for([chunk(1, 7, (item,))]) == 1  # past the image


def test_padded_step_equals_unpadded_and_touches_only_scratch(loaded: tuple[Any, Any]) -> None:
    """Five sequences decoding: the padded (bucket 8) step's logits for the five equal the unpadded step's, and
    the only KV it writes beyond their new slots is the scratch block."""
    adapter, model = loaded
    engine = graph_engine(loaded)
    runner, graphs = engine.runner, engine.runner.graphs
    prompts = [build_prompt(adapter, model, [f"prompt number {i} " * (i + 2)]) for i in range(4)]
    prompts.append(build_prompt(adapter, model, ["an image", image(56, 56, 3), "what?"]))
    results: dict[str, Result] = {}
    for i, prompt in enumerate(prompts):
        for mm_hash, tensor in prompt.embeddings.items():
            engine.provide_embedding(mm_hash, tensor)
        engine.add_request(prompt.request(f"r{i}", SamplingOptions(max_tokens=30, ignore_eos=True)))
    while len(engine.scheduler.running) < 5 or any(
        s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running
    ):
        collect(engine.step(), results)
    scheduled = engine.scheduler.schedule()
    chunks = scheduled.chunks
    assert len(chunks) == 5 and graphs.bucket_for(chunks) == 8
    before = [t.clone() for t in runner.kv.keys]
    steps = graphs.steps
    padded = runner.run(chunks, engine.embeddings)
    assert graphs.steps == steps + 1
    after_padded = [t.clone() for t in runner.kv.keys]
    runner.graphs = None
    try:
        plain = runner.run(chunks, engine.embeddings)
    finally:
        runner.graphs = graphs
    assert [c.seq.request_id for c in padded.sampled] == [c.seq.request_id for c in plain.sampled]
    torch.testing.assert_close(padded.logits, plain.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.logits.argmax(-1), plain.logits.argmax(-1))
    size = runner.block_size
    own = {c.seq.block_table[c.start // size] * size + c.start % size for c in chunks}
    scratch = set(range(runner.num_blocks * size, (runner.num_blocks + 1) * size))
    for layer, (old, new) in enumerate(zip(before, after_padded, strict=True)):
        flat_old, flat_new = old.view(-1, old.shape[2] * old.shape[3]), new.view(-1, new.shape[2] * new.shape[3])
        changed = set(torch.nonzero((flat_old != flat_new).any(dim=1)).view(-1).tolist())
        assert changed <= own | scratch, f"layer {layer} wrote outside its slots: {sorted(changed - own - scratch)}"
        assert changed & scratch, "padded rows write to the scratch block"
    engine.scheduler.update(scheduled)  # the step happened; finish normally from here
    for chunk, token in zip(plain.sampled, plain.logits.argmax(-1).tolist(), strict=True):
        chunk.seq.append_token(token)
    drain(engine, results)
    state = engine.kv_state()
    assert state.free_blocks == state.total_blocks == runner.num_blocks  # the scratch block is never handed out


def test_static_layout_is_fixed_per_bucket(loaded: tuple[Any, Any]) -> None:
    graphs = graph_engine(loaded).runner.graphs
    for bucket in graphs.buckets:
        step = graphs.dummy_step(bucket)
        assert step.layout.num_seqs == bucket and step.layout.width == graphs.table_width
        assert step.layout.max_k == graphs.table_width * graphs.backend.block_size
        assert len(step.ints) + bucket <= graphs.static.numel()


def test_graphs_need_a_varlen_backend(loaded: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="varlen attention backend"):
        graph_engine(loaded, attention_backend="sdpa")
    assert graph_engine(loaded, cuda_graphs="auto").runner.graphs is None  # auto: capture only on CUDA
