"""Build a tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL / LLaVA-1.5 model folder offline and deterministically.

The folder has the same files as a real checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, preprocessor_config.json, generation_config.json; LLaVA also
processor_config.json) and loads with `AutoConfig`, `AutoTokenizer`, `AutoImageProcessor` and
`AutoModelForImageTextToText`. The LLaVA parts live in `tiny_llava` and `tiny_llama_tokenizer`, the Qwen3-VL
ones in `tiny_qwen3_vl`.
Invariants: the model's vocabulary equals `len(tokenizer)`; the same arguments give byte-identical
files on every run (fixed corpus, seeded torch generator, sorted JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.models import tiny_llava, tiny_qwen3_vl
from services.models.tiny_llama_tokenizer import save_llama_tokenizer
from services.models.tiny_tokenizer import save_tokenizer
from services.models.tiny_tokenizer_files import TinyTokenizerInfo

DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
_VOCAB_TARGET = 1024
_MAX_POSITIONS = 32768
# Larger than a trained model's 0.02 so that greedy outputs depend visibly on every input (positions,
# image rows): a wrong rotary index or a misplaced embedding changes the tokens, not just the 5th decimal.
_INIT_RANGE = 0.2


@dataclass(frozen=True)
class _Family:
    model_type: str
    architecture: str


_FAMILIES: dict[str, _Family] = {
    "qwen2-vl": _Family("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2.5-vl": _Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3-vl": _Family("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "llava": _Family("llava", "LlavaForConditionalGeneration"),
}

TINY_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def make_tiny_model(
    out_dir: Path, family: str, max_pixels: int | None = None, seed: int = 0, text_width: int = 64, text_layers: int = 2
) -> Path:
    """Write a tiny random model folder for `family` ("qwen2-vl", "qwen2.5-vl", "qwen3-vl" or "llava") into `out_dir`.

    `max_pixels` caps the Qwen image processor's resize (default 1280*28*28, as the released Qwen2-VL models;
    Qwen3-VL's 16384*32*32; LLaVA's processor always crops to 336x336, so it takes none);
    `seed` selects the random weights. `text_width` (hidden size, a multiple of 64; the MLP is twice
    as wide and there are 4 query and 2 KV heads) and `text_layers` size the language model: the
    defaults make a step cost little more than Python's overhead; a wider, deeper one makes decoding
    bound by reading the weights, as it is on a GPU (benchmarks use that). Returns `out_dir`. Raises
    ValueError on an unknown family or a `max_pixels` below the processor's minimum or a bad size.
    """
    spec = _FAMILIES.get(family)
    if spec is None:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    if spec.model_type == "llava" and max_pixels is not None:
        raise ValueError("max_pixels applies to the Qwen2-VL families; LLaVA-1.5 always crops to 336x336")
    qwen3 = spec.model_type == "qwen3_vl"
    floor = tiny_qwen3_vl.MIN_PIXELS if qwen3 else DEFAULT_MIN_PIXELS
    cap = (tiny_qwen3_vl.MAX_PIXELS if qwen3 else DEFAULT_MAX_PIXELS) if max_pixels is None else max_pixels
    if cap < floor:
        raise ValueError(f"max_pixels must be at least {floor}, got {cap}")
    if text_width <= 0 or text_width % 64 or text_layers <= 0:
        raise ValueError(
            f"text_width must be a positive multiple of 64 and text_layers positive, got {text_width} and {text_layers}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if spec.model_type == "llava":
        info = save_llama_tokenizer(out_dir, _VOCAB_TARGET, tiny_llava.MAX_POSITIONS)
        config = tiny_config(family, info, text_width, text_layers)
        _write_json(out_dir / "config.json", config)
        _write_json(out_dir / "generation_config.json", tiny_llava.llava_generation_config(info))
        _write_json(out_dir / "preprocessor_config.json", tiny_llava.llava_preprocessor_config())
        _write_json(out_dir / "processor_config.json", tiny_llava.llava_processor_config())
        _write_weights(out_dir, config, seed)
        return out_dir
    if qwen3:
        info = save_tokenizer(out_dir, _VOCAB_TARGET, _MAX_POSITIONS, tiny_qwen3_vl.QWEN3_VL_CHAT_TEMPLATE)
        config = tiny_config(family, info, text_width, text_layers)
        _write_json(out_dir / "config.json", config)
        _write_json(out_dir / "generation_config.json", _generation_config(info))
        _write_json(out_dir / "preprocessor_config.json", tiny_qwen3_vl.qwen3_vl_preprocessor_config(cap))
        _write_json(out_dir / "video_preprocessor_config.json", tiny_qwen3_vl.qwen3_vl_video_preprocessor_config())
        _write_weights(out_dir, config, seed)
        return out_dir
    info = save_tokenizer(out_dir, _VOCAB_TARGET, _MAX_POSITIONS)
    config = tiny_config(family, info, text_width, text_layers)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(info))
    _write_json(out_dir / "preprocessor_config.json", _preprocessor_config(cap))
    _write_json(out_dir / "video_preprocessor_config.json", _video_preprocessor_config())
    _write_weights(out_dir, config, seed)
    return out_dir


def tiny_config(family: str, info: TinyTokenizerInfo, width: int = 64, layers: int = 2) -> dict[str, Any]:
    """The config.json of a tiny `family` model for the tokenizer `info` describes (`width` and `layers` as in
    `make_tiny_model`); also what models built in memory, with no folder, start from."""
    spec = _FAMILIES.get(family)
    if spec is None:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    if spec.model_type == "llava":
        return tiny_llava.llava_config(info, text_sizes(info, width, layers), _INIT_RANGE)
    if spec.model_type == "qwen3_vl":
        return tiny_qwen3_vl.qwen3_vl_config(info, text_sizes(info, width, layers), _MAX_POSITIONS, _INIT_RANGE)
    ids = info.special_ids
    scale = width // 64  # head_dim is 16 x scale
    text = {
        **text_sizes(info, width, layers),
        "model_type": f"{spec.model_type}_text",
        "max_position_embeddings": _MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "initializer_range": _INIT_RANGE,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        # head_dim 16 (x scale): the rotary half (8 frequencies) splits over the t, h, w axes.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [2 * scale, 3 * scale, 3 * scale],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "dtype": "float32",
    }
    return {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "text_config": text,
        "vision_config": _vision_config(spec.model_type, width),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def text_sizes(info: TinyTokenizerInfo, width: int, layers: int) -> dict[str, Any]:
    """The size fields of every tiny family's language model config: the vocabulary of `info`, `width` wide
    (the caller checks it is a multiple of 64) and `layers` deep, 4 query heads and 2 KV heads of
    `width // 4` (head_dim 16 at width 64, so the engine's CPU decode kernel applies), a SiLU MLP twice
    as wide."""
    return {
        "vocab_size": info.vocab_size,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
    }


def _vision_config(model_type: str, text_width: int) -> dict[str, Any]:
    common = {
        "depth": 2,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": _INIT_RANGE,
    }
    if model_type == "qwen2_vl":
        return {**common, "model_type": "qwen2_vl_vision", "embed_dim": 32, "hidden_size": text_width, "mlp_ratio": 2}
    return {
        **common,
        "model_type": "qwen2_5_vl_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": text_width,
        "hidden_act": "silu",
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
    }


def _generation_config(info: TinyTokenizerInfo) -> dict[str, Any]:
    ids = info.special_ids
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }


def _preprocessor_config(max_pixels: int) -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def _video_preprocessor_config() -> dict[str, Any]:
    """Qwen2VLVideoProcessor with qwen-vl-utils' numbers: 2 fps, 4..768 frames, 128..768 tokens' worth of pixels
    per frame, and the whole video within 24576 tokens' worth (x 0.9) through the per-frame cap."""
    image = {key: value for key, value in _preprocessor_config(768 * 28 * 28).items() if key != "image_processor_type"}
    return {
        **image,
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
        "do_sample_frames": True,
        "fps": 2.0,
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": True,
        "max_video_tokens": 24576,
    }


def _write_weights(out_dir: Path, config: dict[str, Any], seed: int) -> None:
    """Instantiate the model under a seeded generator and save its weights as one safetensors file."""
    import torch  # here, not at the top: `epd`'s argument parser reads TINY_FAMILIES without loading torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(out_dir)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32)
    state = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}
    save_file(dict(sorted(state.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if config["text_config"]["vocab_size"] != model.lm_head.out_features:
        raise RuntimeError("tiny model vocabulary does not match its tokenizer")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
