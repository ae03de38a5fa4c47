"""The engine's decode step against the bare forward of the same batch, timed alternately in one run.

The bare forward is what the step computes without the engine around it: the same model modules (embedding,
language model with its attention over the paged KV, the head at the sampled rows) on the same rows, contexts
and KV, staged before its clock (`ModelRunner.staged_forward`), so scheduling, the step's metadata, the upload,
sampling, the host read and the outputs are what the ratio counts. Both are timed on the wall clock and in the
process's CPU time (which a busy neighbour on a shared box does not inflate).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from services.models.media_span import MediaSpan
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions
from tests.bench.workload import BenchRequest


@dataclass(frozen=True)
class StepOverhead:
    """Medians over ``steps`` decode steps of ``rows`` sequences at ``context`` tokens each on average, wall clock
    and CPU time."""

    rows: int
    context: int
    steps: int
    engine_step_ms: float
    bare_forward_ms: float
    engine_step_cpu_ms: float
    bare_forward_cpu_ms: float

    @property
    def ratio(self) -> float:
        return self.engine_step_ms / self.bare_forward_ms

    @property
    def cpu_ratio(self) -> float:
        return self.engine_step_cpu_ms / self.bare_forward_cpu_ms

    def line(self) -> str:
        return (
            f"decode step, {self.rows} sequences decoding (mean context {self.context} tokens), {self.steps} steps "
            f"alternating: engine step {self.engine_step_ms:.3f} ms, bare forward {self.bare_forward_ms:.3f} ms "
            f"(overhead ratio {self.ratio:.2f}); CPU {self.engine_step_cpu_ms:.3f} / {self.bare_forward_cpu_ms:.3f} "
            f"ms ({self.cpu_ratio:.2f})"
        )


def measure_step_overhead(
    adapter: Any, model: Any, requests: list[BenchRequest], config: EngineConfig, steps: int
) -> StepOverhead:
    """The first ``config.max_num_seqs`` requests (embeddings given at once, outputs long enough that none ends)
    prefill under the whole token budget until every one decodes; then ``steps`` decode steps, each
    ``Engine.step`` timed, then the bare forward of the chunks it ran, staged before its own clock (each rerun
    rewrites the same K/V into the same slots)."""
    engine = Engine(adapter, model, dataclasses.replace(config, prefill_tokens_per_free_seq=0))
    first = requests[: config.max_num_seqs]
    margin = sum(len(r.token_ids) for r in first) // max(config.max_num_batched_tokens // 2, 1) + len(first)
    batch = [dataclasses.replace(r, max_tokens=steps + margin) for r in first]
    for r in batch:
        media = []
        if r.pixels is not None:
            engine.provide_embedding(r.request_id, r.embedding)
            media = [MediaSpan(r.request_id, r.image_offset, r.image_tokens, r.pixels.grid_thw)]
        sampling = SamplingOptions(max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(EngineRequest(r.request_id, r.token_ids, media, sampling))
    running = engine.scheduler.running
    while not (len(running) == len(batch) and all(s.num_tokens - s.num_computed_tokens == 1 for s in running)):
        if any(out.finished for out in engine.step()):
            raise RuntimeError("a request ended before the whole batch decoded")
    runner = engine.runner
    ours, bare, ours_cpu, bare_cpu = [], [], [], []
    context = sum(s.num_tokens for s in running) // len(running) + steps // 2
    for _ in range(steps):
        started, cpu = time.perf_counter(), time.process_time()
        engine.step()
        ours.append(time.perf_counter() - started)
        ours_cpu.append(time.process_time() - cpu)
        chunks = runner.last_chunks
        if len(chunks) != len(batch) or any(c.num_tokens != 1 for c in chunks):
            raise RuntimeError("a measured step was not a decode step of the whole batch")
        forward = runner.staged_forward(chunks, engine.embeddings)
        started, cpu = time.perf_counter(), time.process_time()
        forward()
        bare.append(time.perf_counter() - started)
        bare_cpu.append(time.process_time() - cpu)
    ms = [1e3 * statistics.median(x) for x in (ours, bare, ours_cpu, bare_cpu)]
    return StepOverhead(len(batch), context, steps, *ms)
