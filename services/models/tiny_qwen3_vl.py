"""The Qwen3-VL parts of a tiny random model folder: config, image processor settings, chat template.

Shaped like Qwen/Qwen3-VL-8B-Instruct with small widths: a vision tower of 16-pixel patches, 2x2 merge and 2-frame
temporal patches (32 pixels per token side), learned position embeddings on a 16 x 16 grid, 2 blocks 32 wide, and
DeepStack feature maps taken after both blocks (`deepstack_visual_indexes` [0, 1]: two levels, added by the
language model after its decoder layers 0 and 1); a Qwen3 language model (`qwen3_vl_text`: q/k norms, an explicit
`head_dim`, interleaved M-RoPE) as wide and deep as the other tiny families. The image processor is
Qwen2VLImageProcessor as Qwen3-VL saves it (patch 16, mean and std 0.5) with small pixel limits; the chat template
is Qwen3-VL's (no default system turn). The video processor is Qwen3VLVideoProcessor with its class defaults (2 fps,
4..768 frames, the whole clip within 128..768 tokens' worth of pixels) and qwen-vl-utils' per-frame cap on.
`tiny_model.make_tiny_model(dir, "qwen3-vl")` writes the folder; these functions only build the dicts.
"""

from __future__ import annotations

from typing import Any

from services.models.tiny_tokenizer_files import TinyTokenizerInfo

PATCH_SIZE = 16
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE
"""Pixels per token side: the resize rule rounds both sides to multiples of it."""
MIN_PIXELS = 2 * 2 * FACTOR * FACTOR
"""Four tokens' worth (a 64 x 64 image), the tiny folders' floor; the released processor's is 64 tokens'."""
MAX_PIXELS = 16384 * FACTOR * FACTOR
"""The released processor's `longest_edge` (16777216): 16384 tokens' worth."""
DEEPSTACK_INDEXES = [0, 1]
_MEAN_STD = [0.5, 0.5, 0.5]

# Qwen3-VL-Instruct's chat template without its tools section: a system turn only when given, images and videos
# as <|vision_start|><|image_pad|><|vision_end|> (or <|video_pad|>), each turn closed by <|im_end|>.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for content in message.content -%}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content.type == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}{{- content.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def qwen3_vl_config(
    info: TinyTokenizerInfo, text_sizes: dict[str, Any], max_positions: int, init_range: float
) -> dict[str, Any]:
    """config.json of a tiny Qwen3-VL for the Qwen2-style tokenizer `info` describes.

    `text_sizes` are the language model's size fields (`tiny_model.text_sizes`), taken as they are; its head_dim is
    width / 4 (16 at width 64) and the rotary half splits over t, h, w as `mrope_section` [2, 3, 3] x scale,
    interleaved as Qwen3-VL does. `init_range` is every weight's standard deviation.
    """
    ids = info.special_ids
    width = int(text_sizes["hidden_size"])
    scale = width // 64
    text = {
        **text_sizes,
        "model_type": "qwen3_vl_text",
        "head_dim": width // int(text_sizes["num_attention_heads"]),
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "initializer_range": init_range,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [2 * scale, 3 * scale, 3 * scale],
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "dtype": "float32",
    }
    vision = {
        "model_type": "qwen3_vl_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "out_hidden_size": width,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": DEEPSTACK_INDEXES,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": init_range,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def qwen3_vl_preprocessor_config(max_pixels: int) -> dict[str, Any]:
    """Qwen2VLImageProcessor as Qwen3-VL saves it (16-pixel patches, mean and std 0.5), from `MIN_PIXELS` to
    `max_pixels`."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": _MEAN_STD,
        "image_std": _MEAN_STD,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": max_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": 2,
        "merge_size": MERGE_SIZE,
    }


def qwen3_vl_video_preprocessor_config() -> dict[str, Any]:
    """Qwen3VLVideoProcessor with its class defaults (2 fps, 4..768 frames, `size` 128..768 tokens' worth of pixels
    over the whole clip, mean and std 0.5) and `cap_pixels_per_frame` on (each frame's share at most 768 tokens'
    worth, at least 1.05 x the floor), so the tests cross the cap's rule."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": _MEAN_STD,
        "image_std": _MEAN_STD,
        "size": {"shortest_edge": 128 * FACTOR * FACTOR, "longest_edge": 768 * FACTOR * FACTOR},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": 2,
        "merge_size": MERGE_SIZE,
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": True,
        "max_video_tokens": 768,
    }
