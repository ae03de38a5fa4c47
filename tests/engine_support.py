"""Helpers for engine tests: prompts with real images, their embeddings, and the engine driven to the end."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from services.models.base import ChatMessage, ChatPart
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, MediaInput, SamplingOptions, StepOutput
from tests import media_factory


@dataclass
class Prompt:
    """A chat prompt with its images, built into token ids and media inputs by the adapter."""

    messages: list[ChatMessage]
    images: list[Image.Image]
    token_ids: list[int]
    media: list[MediaInput]
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
        MediaInput(h, span.offset, span.length, item.grid_thw)
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
