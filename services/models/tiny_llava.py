"""The LLaVA-1.5 parts of a tiny random model folder: config, image processor, processor and generation settings.

Shaped like llava-hf/llava-1.5-7b-hf with small widths: a CLIP vision tower that keeps the released
geometry (336x336 input, 14x14 patches: 24 x 24 = 576 image tokens after dropping CLS, vision feature
layer -2, strategy "default") but is 32 wide and 3 deep; LLaVA's two-layer GELU projector; a Llama language
model with 4 query and 2 KV heads (head_dim 16 at width 64, so the engine's CPU decode kernel applies). The
image processor is CLIPImageProcessor as released: shortest edge to 336 (bicubic), center crop 336x336, CLIP
mean/std; `processor_config.json` holds what transformers' LlavaProcessor needs to expand `<image>` itself.
`tiny_model.make_tiny_model(dir, "llava")` writes the folder; these functions only build the dicts.

Weights: the language model and the tower at the tiny models' wide 0.2, but the projector and `lm_head` (the
LLaVA model's own modules, drawn at its top-level `initializer_range`) at 0.05. With 0.2 there too the 576
projected rows of a smooth image are ~8x the norm of a text embedding and nearly alike, and greedy output after
an image collapsed to one repeated token whatever the prompt (seed 0), which no oracle test could tell apart; a
3-layer tower (so layer -2 is not the first) spreads the rows further.
"""

from __future__ import annotations

from typing import Any

from services.models.tiny_tokenizer_files import TinyTokenizerInfo

IMAGE_SIZE = 336
PATCH_SIZE = 14
MAX_POSITIONS = 4096
"""Llama-2 / Vicuna-1.5's context, as in the released LLaVA-1.5."""
PROJECTOR_INIT_RANGE = 0.05
"""Standard deviation of the projector's and `lm_head`'s weights (see the module docstring)."""
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def llava_config(info: TinyTokenizerInfo, text_sizes: dict[str, Any], init_range: float) -> dict[str, Any]:
    """config.json of a tiny LLaVA-1.5 for the Llama-style tokenizer `info` describes.

    `text_sizes` are the language model's size fields (`tiny_model.text_sizes`: vocabulary, width, depth,
    heads, activation), taken as they are. `init_range` is the language model's and the tower's weights'
    standard deviation; the projector and head use `PROJECTOR_INIT_RANGE`.
    """
    ids = info.special_ids
    text = {
        **text_sizes,
        "model_type": "llama",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "initializer_range": init_range,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "dtype": "float32",
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
        "initializer_range": init_range,
        "initializer_factor": 1.0,
    }
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision,
        "image_token_index": ids["<image>"],
        "image_seq_length": (IMAGE_SIZE // PATCH_SIZE) ** 2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "pad_token_id": ids["<pad>"],
        "initializer_range": PROJECTOR_INIT_RANGE,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def llava_preprocessor_config() -> dict[str, Any]:
    """preprocessor_config.json: CLIPImageProcessor with LLaVA-1.5's released settings."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
    }


def llava_processor_config() -> dict[str, Any]:
    """processor_config.json: what LlavaProcessor needs to count an image's `<image>` tokens (576 here)."""
    return {
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
    }


def llava_generation_config(info: TinyTokenizerInfo) -> dict[str, Any]:
    """generation_config.json: Llama's bos/eos, LLaVA's pad, greedy."""
    ids = info.special_ids
    return {
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "do_sample": False,
    }
