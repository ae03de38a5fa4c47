"""Correctness oracle: transformers' own greedy `generate` on a model folder.

Built as independently of our adapter as possible: the tokenizer's chat template, the image
processor's own output, placeholders expanded in text from `image_grid_thw // merge**2` (as
Qwen2VLProcessor does), and `model.generate(do_sample=False)` on the full model. Families whose combined
processor builds without torchvision (`_PROCESSOR_FAMILIES`: LLaVA's LlavaProcessor) get their prompt ids
and pixels from that processor itself, loaded from the folder.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from services.models.base import ChatMessage, ChatPart


@dataclass(frozen=True)
class _Loaded:
    model: Any
    tokenizer: Any
    image_processor: Any


_PROCESSOR_FAMILIES = ("llava",)
"""model_types whose transformers processor (AutoProcessor) loads here: the oracle uses it whole."""


@functools.lru_cache(maxsize=4)
def _processor(model_dir: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir, local_files_only=True)


@functools.lru_cache(maxsize=4)
def _load(model_dir: str) -> _Loaded:
    """Model, tokenizer and processor for a folder, loaded once per test session."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    return _Loaded(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
        image_processor=AutoImageProcessor.from_pretrained(model_dir, local_files_only=True),
    )


def _hf_part(part: ChatPart) -> dict[str, str]:
    return {"type": "image"} if part.kind == "image" else {"type": "text", "text": part.text}


def _generate(model_dir: Path, messages: list[ChatMessage], images: list[Image.Image], max_tokens: int, **kwargs: Any):
    """`model.generate(do_sample=False)` on the prompt built as Qwen2VLProcessor does; its output and prompt length."""
    loaded = _load(str(Path(model_dir).resolve()))
    config = loaded.model.config
    pad = loaded.tokenizer.convert_ids_to_tokens(config.image_token_id)
    conversation = [{"role": m.role, "content": [_hf_part(p) for p in m.parts]} for m in messages]
    text = loaded.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if config.model_type in _PROCESSOR_FAMILIES:
        folder = str(Path(model_dir).resolve())
        return _generate_with_processor(loaded.model, folder, text, images, max_tokens, **kwargs)
    extra: dict[str, Any] = {}
    if images:
        pixels = loaded.image_processor(images=images, return_tensors="pt")
        merge = loaded.image_processor.merge_size
        for grid in pixels["image_grid_thw"]:
            text = text.replace(pad, "<|placeholder|>" * (int(grid.prod()) // merge**2), 1)
        text = text.replace("<|placeholder|>", pad)
        extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
    encoded = loaded.tokenizer(text, return_tensors="pt")
    input_ids = encoded["input_ids"]
    mm_token_type_ids = (input_ids == config.image_token_id).to(torch.int32)
    with torch.no_grad():
        out = loaded.model.generate(
            input_ids=input_ids,
            attention_mask=encoded["attention_mask"],
            mm_token_type_ids=mm_token_type_ids,
            max_new_tokens=max_tokens,
            do_sample=False,
            **extra,
            **kwargs,
        )
    return out, input_ids.shape[1]


def _generate_with_processor(
    model: Any, model_dir: str, text: str, images: list[Image.Image], max_tokens: int, **kwargs: Any
):
    """`model.generate(do_sample=False)` on the ids and pixels the folder's own processor makes from `text`."""
    encoded = _processor(model_dir)(images=images or None, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False, **kwargs)
    return out, encoded["input_ids"].shape[1]


def hf_generate(model_dir: Path, messages: list[ChatMessage], images: list[Image.Image], max_tokens: int) -> list[int]:
    """Greedy completion token ids (prompt excluded) from `model.generate`; stops at eos or max_tokens."""
    out, prompt_len = _generate(model_dir, messages, images, max_tokens)
    return out[0, prompt_len:].tolist()


def hf_generate_logits(
    model_dir: Path, messages: list[ChatMessage], images: list[Image.Image], max_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """`hf_generate`'s tokens and the raw logits ``[tokens, vocab]`` each was chosen from (`output_logits`)."""
    out, prompt_len = _generate(
        model_dir, messages, images, max_tokens, output_logits=True, return_dict_in_generate=True
    )
    return out.sequences[0, prompt_len:].tolist(), torch.cat(out.logits, dim=0).float()
