"""Baseline: transformers' `generate` with static batches (take what has arrived, run it to the end)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer
from transformers.modeling_outputs import BaseModelOutputWithPooling

from services.models import deepstack
from tests.bench.workload import BenchRequest, Timeline


class _StepClock(BaseStreamer):
    """Timestamps every generation step (the first `put` is the prompt)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter() - self.start)
        self._seen_prompt = True

    def end(self) -> None:
        pass


def run_static_batches(
    adapter: Any, model: Any, requests: list[BenchRequest], batch_size: int, colocated: bool
) -> list[Timeline]:
    """Run the workload in arrival order, `batch_size` at most per `generate`, each batch to its longest output.

    Images go in as the embeddings computed beforehand (`mm_encoder_outputs`), or, `colocated`, as pixels
    for the vision tower inside `generate`.
    """
    timelines = [Timeline(r.arrival_s) for r in requests]
    pending = list(range(len(requests)))
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        first = requests[pending[0]].arrival_s
        if first > now:
            time.sleep(first - now)
            now = first
        batch = [i for i in pending[:batch_size] if requests[i].arrival_s <= now]
        pending = pending[len(batch) :]
        clock = _StepClock(start)
        _generate(adapter, model, [requests[i] for i in batch], clock, colocated)
        for i in batch:
            timelines[i].token_times = clock.times[: requests[i].max_tokens]
    return timelines


def _generate(adapter: Any, model: Any, batch: list[BenchRequest], clock: _StepClock, colocated: bool) -> None:
    pad = adapter.tokenizer.pad_token_id
    length = max(len(r.token_ids) for r in batch)
    ids = torch.tensor([[pad] * (length - len(r.token_ids)) + r.token_ids for r in batch])
    mask = torch.tensor([[0] * (length - len(r.token_ids)) + [1] * len(r.token_ids) for r in batch])
    extra: dict[str, Any] = {}
    images = [r for r in batch if r.pixels is not None]
    if images:
        extra["image_grid_thw"] = torch.tensor([r.pixels.grid_thw for r in images])
        if colocated:
            extra["pixel_values"] = torch.cat([r.pixels.pixel_values for r in images])
        else:
            extra["mm_encoder_outputs"] = {"image": _encoder_outputs(adapter, [r.embedding for r in images])}
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], do_sample=False, pad_token_id=pad, max_new_tokens=max(r.max_tokens for r in batch))
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            mm_token_type_ids=(ids == adapter.image_token_id).to(torch.int32),
            generation_config=config,
            streamer=clock,
            **extra,
        )


def _encoder_outputs(adapter: Any, embeddings: list[torch.Tensor]) -> Any:
    """The tower's outputs `generate` takes for our embeddings: the projected rows, and for a layout with DeepStack
    levels (services/models/deepstack.py; Qwen3-VL) each level's rows as `deepstack_features`."""
    hidden = int(adapter.hidden_size)
    levels = int(adapter.embedding_width) // hidden - 1
    mains = tuple(deepstack.main_rows(e, hidden) for e in embeddings)
    if not levels:
        return BaseModelOutputWithPooling(pooler_output=mains)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    features = [tuple(deepstack.level_rows(e, hidden, k) for e in embeddings) for k in range(levels)]
    return BaseModelOutputWithDeepstackFeatures(pooler_output=mains, deepstack_features=features)
