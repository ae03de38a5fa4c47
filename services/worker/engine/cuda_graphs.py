"""Decode-only steps at padded batch sizes: captured and replayed as CUDA graphs, or run eagerly the same way.

A decode step launches hundreds of small kernels; replaying a captured graph launches one. A graph reads
fixed addresses and shapes, so a step of ``B`` one-token rows is padded to the next bucket ``b``
(1, 2, 4, 8, then every 16 up to ``max_num_seqs``): the padded rows are one-token queries writing K/V to
a scratch block that no sequence owns, and every block-table row is ``table_width`` wide (the most blocks
a sequence may hold), so a ``b``-row step always has the same packed-ints layout. Its ints are copied
(pinned, non-blocking) into one static buffer, from which bucket ``b``'s graph was captured; the logits of
all ``b`` rows land in a static output. Steps with longer chunks, media rows, or more rows than the largest
bucket run eagerly. Everything but the capture itself also runs on the CPU (``capture=False``: the same
padding, buffers and forward, without a graph), which is how the tests prove it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.engine.attention.backend import AttentionBackend
from services.worker.engine.host_device import HostDevice
from services.worker.engine.scheduler import ScheduledChunk
from services.worker.engine.step_input import PaddedRows, StepInput, build_step_input

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16

Forward = Callable[[StepInput, torch.Tensor], torch.Tensor]
"""``(step, packed ints on the device) -> logits [rows, vocab]`` of every row of the step (the runner's; passed
in each call rather than held, so the graphs keep no reference back to the runner)."""


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every 16, and ``max_num_seqs`` itself."""
    sizes = {b for b in SMALL_BUCKETS if b < max_num_seqs} | set(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    return sorted(sizes | {max_num_seqs})


@dataclass(frozen=True)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    layout: Any  # the step layout it was captured with: a replayed step must match it


class DecodeGraphs:
    """Padded decode steps over one static ints buffer, replayed from graphs (``capture``) or run eagerly.

    Invariant: ``static`` holds the packed ints of the step being run (a ``b``-row step's layout is fixed
    by ``b`` and ``table_width``); bucket ``b``'s graph reads views of it and writes ``logits[:b]``;
    padded rows touch only ``scratch_block``.
    """

    def __init__(
        self, backend: AttentionBackend, io: HostDevice, max_num_seqs: int, table_width: int, scratch_block: int,
        vocab_size: int, logits_dtype: torch.dtype, capture: bool,
    ) -> None:  # fmt: skip
        self.backend = backend
        self.io = io
        self.buckets = graph_buckets(max_num_seqs)
        self.table_width = table_width
        self.scratch_block = scratch_block
        self.capture_graphs = capture
        largest = self.buckets[-1]
        device = io.device
        self.static = torch.zeros(self._ints_size(largest), dtype=torch.int64, device=device)
        self.logits = torch.zeros(largest, vocab_size, dtype=logits_dtype, device=device) if capture else None
        self._graphs: dict[int, _Captured] = {}
        self.steps = 0  # steps run through the graphs (replayed, or eagerly without capture)
        self.last_step: StepInput | None = None  # the step whose ints ``static`` holds

    def bucket_for(self, chunks: list[ScheduledChunk]) -> int | None:
        """The bucket a step of ``chunks`` pads to, or None when it must run eagerly."""
        count = len(chunks)
        if count == 0 or count > self.buckets[-1]:
            return None
        for chunk in chunks:
            if chunk.num_tokens != 1 or _in_media(chunk):
                return None
        return self.buckets[bisect.bisect_left(self.buckets, count)]

    def padding(self, bucket: int, rows: int) -> PaddedRows:
        return PaddedRows(bucket - rows, self.scratch_block, self.scratch_block * self.backend.block_size)

    def run(self, step: StepInput, forward: Forward) -> torch.Tensor:
        """Logits ``[b, vocab]`` of every row of the padded ``step`` (``b`` rows, laid out with ``table_width``);
        ``forward`` is what was captured (run eagerly without capture)."""
        self.io.upload(step.ints, torch.int64, out=self.static)
        self.steps += 1
        self.last_step = step
        return self.rerun(step, forward)

    def rerun(self, step: StepInput, forward: Forward) -> torch.Tensor:
        """The forward of the step ``run`` last uploaded, alone: a graph replay, or the eager forward. Running it
        again rewrites the same K/V into the same slots (benchmarks time it as the bare decode step)."""
        if not self.capture_graphs:
            return forward(step, self.static[: len(step.ints)])
        captured = self._graphs[step.num_tokens]
        if captured.layout != step.layout:
            raise RuntimeError(f"step layout {step.layout} differs from the captured {captured.layout}")
        captured.graph.replay()
        return self.logits[: step.num_tokens]

    def sample_rows(self, step: StepInput) -> torch.Tensor:
        """The rows to sample, as a view of the static buffer (``run`` put them there)."""
        return self.static[step.sample_at : step.sample_at + len(step.sample_rows)]

    @torch.inference_mode()
    def capture(self, forward: Forward) -> None:
        """Capture ``forward`` for every bucket, largest first, sharing one memory pool (CUDA only). Each bucket
        is warmed up on the capture's side stream first (lazy initialisation, cuBLAS workspaces)."""
        pool = None
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            step = self.dummy_step(bucket)
            self.io.upload(step.ints, torch.int64, out=self.static)
            packed = self.static[: len(step.ints)]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.logits[:bucket].copy_(forward(step, packed))
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[:bucket].copy_(forward(step, packed))
            pool = graph.pool()
            self._graphs[bucket] = _Captured(graph, step.layout)
        torch.cuda.synchronize()

    def dummy_step(self, bucket: int) -> StepInput:
        """A step of ``bucket`` padded rows only (what capture runs)."""
        step = build_step_input([], self.backend.block_size, None, self.padding(bucket, 0))  # type: ignore[arg-type]
        self.backend.lay_out(step, self.table_width)
        step.close()
        return step

    def _ints_size(self, bucket: int) -> int:
        return len(self.dummy_step(bucket).ints) + bucket  # + the sample rows


def _in_media(chunk: ScheduledChunk) -> bool:
    """Whether the chunk's token is a media placeholder (its embedding row is swapped in: eager only)."""
    return any(m.offset <= chunk.start < m.offset + m.num_tokens for m in chunk.seq.media)
