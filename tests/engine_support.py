"""Helpers for engine tests: prompts with real images, their embeddings, and the engine driven to the end."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from services.models.base import ChatMessage, ChatPart
from services.models.media_span import MediaSpan
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions, StepOutput
from tests import media_factory


@dataclass
class Prompt:
    """A chat prompt with its images, built into token ids and media inputs by the adapter."""

    messages: list[ChatMessage]
    images: list[Image.Image]
    token_ids: list[int]
    media: list[MediaSpan]
    embeddings: dict[str, torch.Tensor]

    def request(self, request_id: str, sampling: SamplingOptions, cache_salt: str = "") -> EngineRequest:
        return EngineRequest(request_id, list(self.token_ids), list(self.media), sampling, cache_salt)


def image(width: int, height: int, seed: int) -> Image.Image:
    return media_factory.image(width, height, seed=seed)


def build_prompt(adapter: Any, model: Any, parts: list[str | Image.Image]) -> Prompt:
    """One user message from text and image parts; embeddings come from the real vision tower."""
    chat = [ChatPart("image") if isinstance(p, Image.Image) else ChatPart("text", p) for p in parts]
    messages = [ChatMessage("user", chat)]
    images = [p for p in parts if isinstance(p, Image.Image)]
    items = [adapter.image_tokens(im.width, im.height) for im in images]
    built = adapter.build_prompt(messages, items)
    hashes = [hashlib.sha256(im.tobytes() + str(im.size).encode()).hexdigest() for im in images]
    media = [
        MediaSpan(h, span.offset, span.num_tokens, item.grid_thw)
        for h, span, item in zip(hashes, built.spans, items, strict=True)
    ]
    tensors = adapter.encode(model, [adapter.preprocess(im) for im in images]) if images else []
    return Prompt(messages, images, built.token_ids, media, dict(zip(hashes, tensors, strict=True)))


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0


def drain(engine: Engine, results: dict[str, Result], max_steps: int = 100_000) -> None:
    """Step until no request can make progress, collecting outputs."""
    for _ in range(max_steps):
        if not engine.has_work():
            return
        collect(engine.step(), results)
    raise AssertionError("engine did not finish")


def collect(outputs: list[StepOutput], results: dict[str, Result]) -> None:
    for out in outputs:
        result = results.setdefault(out.request_id, Result())
        result.tokens.extend(out.new_token_ids)
        result.cached_tokens = out.cached_tokens
        if out.finished:
            result.finish_reason = out.finish_reason


def reference(model_dir: Path, prompt: Prompt, max_tokens: int) -> list[int]:
    """transformers' greedy `generate` for the prompt alone."""
    from tests.oracle import hf_generate

    return hf_generate(model_dir, prompt.messages, prompt.images, max_tokens)


BACKENDS = {
    "kernel": ("cpu-kernel", 16, "off"),
    "sdpa": ("sdpa", 16, "off"),
    "flashref16": ("flash-reference", 16, "off"),
    "flashref256-graphs": ("flash-reference", 256, "eager"),  # decode-only steps padded as the GPU graphs are
}
"""The CPU attention paths exactness tests cover: name -> (attention backend, block size, CUDA graph mode)."""
INTERPRETED = {
    "triton16": ("triton", 16, "off"),
    "triton256-graphs": ("triton", 256, "eager"),
}
"""Paths whose kernel runs in Triton's interpreter on the CPU (slow: the exactness tests run them at one budget)."""


def backend_config(backend: str, budget: int, caching: bool) -> EngineConfig:
    """The engine config of one exactness case: ``BACKENDS[backend]`` (or ``INTERPRETED``), a token budget,
    prefix caching on/off."""
    name, block_size, graphs = {**BACKENDS, **INTERPRETED}[backend]
    return EngineConfig(
        kv_cache_bytes=16 << 20,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        enable_prefix_caching=caching,
        attention_backend=name,
        cuda_graphs=graphs,
        max_model_len=4096,
    )


LONG = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm window " * 3


def mixed_workload(adapter: Any, model: Any, model_dir: Path) -> list[tuple[Prompt, int, list[int]]]:
    """16 prompts of different shapes (text only, one to three images, shared prefixes, a repeated image),
    their max_tokens, and `generate`'s completion of each alone."""
    big, small, tall = image(448, 448, 1), image(56, 56, 2), image(90, 300, 3)
    wide, mid, other = image(300, 200, 4), image(224, 224, 5), image(448, 448, 6)
    parts: list[list[Any]] = [
        ["hi"],
        [LONG],
        [small, "what is this?"],
        [big, "describe the picture in detail"],
        [big, "describe the picture briefly"],  # shares the prefix with the one above, image included
        [other, "describe the picture in detail"],  # same text, different image
        [tall, wide, "compare these two"],
        [mid, small, big, "three images: which is largest?"],
        ["before the image " + LONG, wide, "and after it"],
        [LONG + " once more", mid],
        ["short question?"],
        [small, small, "twice the same image"],
        [LONG, tall, LONG],
        ["count to ten"],
        [wide, "what colour dominates here, and why do you think so?"],
        [mid, "a", big, "b", tall, "c"],
    ]
    out = []
    for i, p in enumerate(parts):
        prompt = build_prompt(adapter, model, p)
        max_tokens = 6 + (i * 5) % 23
        out.append((prompt, max_tokens, reference(model_dir, prompt, max_tokens)))
    return out


INTERPRETED_REQUESTS = (0, 3, 4, 11, 14, 7, 2, 10)
"""The requests of `mixed_workload` an interpreted case runs (Triton's interpreter is ~100x slower than the CPU
paths), still concurrent: text only, a 300-token image prompt chunked at budget 64 across a 256-token block's
boundary and a second one sharing its image prefix (served from the prefix cache), a repeated image, three
images, one stopping on EOS before max_tokens; two groups of four, so half the embeddings still arrive late."""


def interpreted_workload(workload: list[tuple[Prompt, int, list[int]]]) -> list[tuple[Prompt, int, list[int]]]:
    """``workload``'s `INTERPRETED_REQUESTS`, in that order (each with its own `generate` completion); one of
    them is longer than a 256-token block."""
    chosen = [workload[i] for i in INTERPRETED_REQUESTS]
    assert max(len(prompt.token_ids) for prompt, _, _ in chosen) > 256, "no prompt crosses a 256-token block"
    return chosen


def run_workload(engine: Engine, workload: list[tuple[Prompt, int, list[int]]]) -> dict[str, Result]:
    """The requests in groups of four a step apart, half the embeddings late; checks every output equals
    `generate` and that everything is given back."""
    results: dict[str, Result] = {}
    late: list[Prompt] = []
    for i, (prompt, max_tokens, _) in enumerate(workload):
        if i % 2:  # half the embeddings arrive before their request, half a few steps after
            for mm_hash, tensor in prompt.embeddings.items():
                engine.provide_embedding(mm_hash, tensor)
        else:
            late.append(prompt)
        engine.add_request(prompt.request(f"r{i}", SamplingOptions(max_tokens=max_tokens)))
        if i % 4 == 3:  # arrivals in groups of four, a step apart
            collect(engine.step(), results)
            for prompt in late:
                for mm_hash, tensor in prompt.embeddings.items():
                    engine.provide_embedding(mm_hash, tensor)
            late.clear()
    drain(engine, results)
    for i, (_, max_tokens, expected) in enumerate(workload):
        got = results[f"r{i}"]
        assert got.tokens == expected, f"request {i} (max_tokens {max_tokens})"
        assert got.finish_reason == ("length" if len(expected) == max_tokens else "stop")
    state = engine.kv_state()
    assert state.free_blocks == state.total_blocks and state.reserved_blocks == 0
    assert engine.embedding_stats().pinned == 0
    return results
