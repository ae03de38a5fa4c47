"""What the GPU check runs: random-weight models built from configs, token-id prompts with random images, the
`generate` reference, and the timing of the engine and of `generate`."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from services.models.base import PixelInputs
from services.models.media_span import MediaSpan
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.tiny_model import tiny_config
from services.models.tiny_tokenizer import TinyTokenizerInfo
from services.worker.engine.engine import Engine
from services.worker.engine.request import EngineRequest, SamplingOptions

SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
TINY_VOCAB = 1024


# ----- models -----


def tiny_model(device: torch.device, dtype: torch.dtype, width: int, layers: int) -> tuple[Any, Qwen2VLAdapter]:
    """A small random Qwen2-VL (the test suite's shape), its special tokens at the top of a 1024 vocabulary."""
    info = TinyTokenizerInfo(TINY_VOCAB, {name: TINY_VOCAB - len(SPECIAL) + i for i, name in enumerate(SPECIAL)})
    return build(tiny_config("qwen2-vl", info, width, layers), device, dtype)


def seven_b(device: torch.device, dtype: torch.dtype, text_layers: int | None = None) -> tuple[Any, Qwen2VLAdapter]:
    """Qwen2-VL-7B's shape with random weights (``text_layers`` trims the language model)."""
    from services.models.shapes import qwen2_vl_7b_config

    return build(qwen2_vl_7b_config(text_layers=text_layers), device, dtype)


def build(config: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, Qwen2VLAdapter]:
    import transformers

    from services.models.shapes import random_model

    if isinstance(config, dict):
        config = transformers.AutoConfig.for_model(**config)
    model = random_model(config, device, dtype)
    return model, Qwen2VLAdapter.from_config(model.config)


def text_id_limit(model: Any) -> int:
    """Ids below this are plain text (the special and media tokens sit above)."""
    config = model.config
    text = config.get_text_config()
    specials = [config.image_token_id, config.video_token_id, config.vision_start_token_id,
                config.vision_end_token_id, text.eos_token_id, text.bos_token_id]  # fmt: skip
    return min(int(s) for s in specials if isinstance(s, int))


# ----- prompts and the reference -----


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    media: list[MediaSpan]
    pixels: list[PixelInputs]
    embeddings: list[torch.Tensor]


def mixed_prompt(adapter: Qwen2VLAdapter, model: Any, index: int, gen: torch.Generator) -> Prompt:
    """Text around ``index % 4`` random images of different grids, then a few more text ids."""
    config = model.config
    limit = text_id_limit(model)
    ids = random_ids(gen, 5 + index % 7, limit)
    media, pixels = [], []
    for image in range(index % 4):
        h, w = 2 * (2 + (index + image) % 4), 2 * (2 + (index * 3 + image) % 5)
        grid = (1, h, w)
        ids.append(config.vision_start_token_id)
        media.append(MediaSpan(f"img-{index}-{image}", len(ids), h * w // 4, grid))
        ids.extend([config.image_token_id] * (h * w // 4))
        ids.append(config.vision_end_token_id)
        ids.extend(random_ids(gen, 1 + image, limit))
        pixels.append(PixelInputs(torch.randn(h * w, 3 * 2 * 14 * 14, generator=gen), grid))
    embeddings = adapter.encode(model, pixels) if pixels else []
    return Prompt(ids, media, pixels, [e.detach() for e in embeddings])


def random_ids(gen: torch.Generator, count: int, limit: int) -> list[int]:
    return torch.randint(0, limit, (count,), generator=gen).tolist()


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    scores: list[torch.Tensor]  # logits of each generated step


def generate_reference(model: Any, prompt: Prompt, max_tokens: int) -> Reference:
    """Greedy ``generate`` for the prompt alone, with the logits of each step."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt.token_ids], device=device)
    extra: dict[str, Any] = {"attention_mask": torch.ones_like(input_ids)}
    if prompt.pixels:
        extra["pixel_values"] = torch.cat([p.pixel_values for p in prompt.pixels]).to(device)
        extra["image_grid_thw"] = torch.tensor([p.grid_thw for p in prompt.pixels], device=device)
    extra["mm_token_type_ids"] = (input_ids == model.config.image_token_id).to(torch.int32)
    settings = {"max_new_tokens": max_tokens, "do_sample": False, "output_scores": True,
                "return_dict_in_generate": True}  # fmt: skip
    with torch.no_grad():
        try:
            out = model.generate(input_ids=input_ids, **settings, **extra)
        except (TypeError, ValueError) as exc:  # an older transformers without mm_token_type_ids
            if "mm_token_type_ids" not in str(exc):
                raise
            extra.pop("mm_token_type_ids")
            out = model.generate(input_ids=input_ids, **settings, **extra)
    return Reference(out.sequences[0, input_ids.shape[1] :].tolist(), [s[0].float().cpu() for s in out.scores])


def diverges_at_tie(got: list[int], ref: Reference) -> bool:
    """Whether the first difference is where generate's top two logits are within 1e-4 (a tie)."""
    for step, (a, b) in enumerate(zip(got, ref.tokens, strict=False)):
        if a != b:
            top = torch.topk(ref.scores[step], 2).values
            return float(top[0] - top[1]) < 1e-4
    return False


def run_engine(engine: Engine, prompts: list[Prompt], max_tokens: int, tag: str) -> list[list[int]]:
    """Greedy answers of all prompts, arriving four at a time a step apart."""
    results: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        for item, tensor in zip(prompt.media, prompt.embeddings, strict=True):
            engine.provide_embedding(item.mm_hash, tensor)
        sampling = SamplingOptions(max_tokens=max_tokens)
        engine.add_request(EngineRequest(f"{tag}{i}", prompt.token_ids, prompt.media, sampling))
        if i % 4 == 3:
            collect(engine.step(), results)
    while engine.has_work():
        collect(engine.step(), results)
    return [results.get(f"{tag}{i}", []) for i in range(len(prompts))]


def collect(outputs: list[Any], results: dict[str, list[int]]) -> None:
    for out in outputs:
        results.setdefault(out.request_id, []).extend(out.new_token_ids)


# ----- timing -----


@dataclass(frozen=True)
class Timed:
    tokens_per_s: float
    itl_s: float
    itl_p99_s: float
    bare_step_s: float | None = None  # the engine's own decode forward replayed alone (graphs only)


def generate_timed(model: Any, prompts: list[list[int]], new_tokens: int) -> Timed:
    """``generate`` on a static batch: decode latency from a 1-token run and a ``new_tokens`` run."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}

    def run(count: int) -> float:
        sync(device)
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=count, min_new_tokens=count, **kwargs)
        sync(device)
        return time.perf_counter() - started

    run(2)  # warm-up
    first = run(1)
    total = run(new_tokens)
    itl = (total - first) / (new_tokens - 1)
    return Timed(len(prompts) * new_tokens / total, itl, itl)


def engine_timed(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str, bare_repeats: int = 20) -> Timed:
    """All prompts at once; each step in which every request decodes is one inter-token latency. Halfway, the
    last decode step's forward is replayed alone ``bare_repeats`` times (the bare step: its graph, same rows and
    contexts)."""
    sampling = SamplingOptions(max_tokens=new_tokens, ignore_eos=True)
    sync(engine.runner.device)
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}{i}", ids, [], sampling))
    steps: list[float] = []
    bare = None
    running = engine.scheduler.running
    while engine.has_work():
        decoding = len(running) == len(prompts) and all(s.num_tokens - s.num_computed_tokens == 1 for s in running)
        step_start = time.perf_counter()
        engine.step()  # ends with the step's one device-to-host copy: the step is done on the device too
        if decoding:
            steps.append(time.perf_counter() - step_start)
            if len(steps) == new_tokens // 2:
                pause = time.perf_counter()
                bare = bare_step_seconds(engine, bare_repeats)
                started += time.perf_counter() - pause  # not part of the engine's time
    total = time.perf_counter() - started
    steps.sort()
    p99 = steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else float("nan")
    return Timed(len(prompts) * new_tokens / total, statistics.median(steps) if steps else float("nan"), p99, bare)


def bare_step_seconds(engine: Engine, repeats: int = 20) -> float | None:
    """The last decode step's forward again, back to back (it rewrites the same K/V to the same slots)."""
    graphs, runner = engine.runner.graphs, engine.runner
    if graphs is None or graphs.last_step is None:
        return None
    with torch.inference_mode():
        sync(runner.device)
        started = time.perf_counter()
        for _ in range(repeats):
            graphs.rerun(graphs.last_step, runner.all_logits)
        sync(runner.device)
    return (time.perf_counter() - started) / repeats


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
