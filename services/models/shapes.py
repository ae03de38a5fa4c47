"""Released model shapes as in-memory transformers configs, and random-weight models built from them (benchmarks).

`qwen2_vl_7b_config` is Qwen2-VL-7B-Instruct's architecture (vision tower: depth 32, width 1280, 16 heads,
MLP ratio 4, 14-pixel patches, 2x2 merge, 2-frame temporal patches, merger out 3584; language model: hidden
3584, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocabulary 152064, M-RoPE sections [16, 24, 24]) with no
download; `text_layers` trims the language model when only the tower matters, and keyword overrides shrink
any size (tests). `random_model` builds the model from a config directly on a device with random weights,
and `random_pixel_inputs` makes pixel inputs of given patch grids, so a GPU benchmark can time
`Qwen2VLAdapter.encode` (or `qwen2_vl_vision.run_vision_tower`) at the real shape. `qwen3_vl_8b_config` is
Qwen3-VL-8B-Instruct's (vision: depth 27, width 1152, 16 heads, MLP 4304, 16-pixel patches, 2x2 merge, a 48 x 48
learned position grid, DeepStack after blocks 8, 16 and 24, merger out 4096; language model: hidden 4096, 36
layers, 32 heads, 8 KV heads of 128, MLP 12288, vocabulary 151936, 262144 positions, interleaved M-RoPE sections
[24, 20, 20]), for planning without a download. `qwen2_5_vl_72b_config` is Qwen2.5-VL-72B-Instruct's (vision:
depth 32, width 1280, 16 heads, MLP 3456, windowed attention with full blocks 7/15/23/31, merger out 8192;
language model: hidden 8192, 80 layers, 64 heads, 8 KV heads of 128, MLP 29568, vocabulary 152064), for sizing
tensor parallelism (`epd plan --device-memory-gb`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

from services.models.base import PixelInputs

QWEN2_VL_7B_VISION: dict[str, Any] = {
    "depth": 32,
    "embed_dim": 1280,
    "num_heads": 16,
    "mlp_ratio": 4,
    "hidden_act": "quick_gelu",
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "hidden_size": 3584,  # the merger's output: the language model's width (Qwen2.5-VL calls it out_hidden_size)
}
QWEN2_VL_7B_TEXT: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 28,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN2_VL_7B_TOKENS: dict[str, int] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def qwen2_vl_7b_config(
    text_layers: int | None = None,
    *,
    vision: dict[str, Any] | None = None,
    text: dict[str, Any] | None = None,
) -> Qwen2VLConfig:
    """Qwen2-VL-7B's config (see the module docstring), with ``text_layers`` decoder layers (None: all 28).

    ``vision`` / ``text`` override fields of the vision / text sub-configs (``Qwen2VLVisionConfig`` /
    ``Qwen2VLTextConfig`` names), e.g. to shrink it for a CPU test. Raises ValueError for ``text_layers < 1``.
    """
    text_fields = {**QWEN2_VL_7B_TEXT, **(text or {})}
    if text_layers is not None:
        if text_layers < 1:
            raise ValueError(f"text_layers must be at least 1, got {text_layers}")
        text_fields["num_hidden_layers"] = text_layers
        text_fields["max_window_layers"] = text_layers
    text_fields["rope_parameters"] = dict(text_fields["rope_parameters"])
    return Qwen2VLConfig(
        vision_config={**QWEN2_VL_7B_VISION, **(vision or {})},
        text_config=text_fields,
        tie_word_embeddings=False,
        **QWEN2_VL_7B_TOKENS,
    )


def qwen2_5_vl_72b_config() -> Qwen2_5_VLConfig:
    """Qwen2.5-VL-72B-Instruct's config (see the module docstring)."""
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3456, "num_heads": 16, "in_channels": 3,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 8192, "hidden_act": "silu"}  # fmt: skip
    text = {**QWEN2_VL_7B_TEXT, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "max_window_layers": 80,
            "max_position_embeddings": 128000}  # fmt: skip
    text["rope_parameters"] = dict(text["rope_parameters"])
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, tie_word_embeddings=False, **QWEN2_VL_7B_TOKENS)


QWEN3_VL_8B_VISION: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 4096,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
}
QWEN3_VL_8B_TEXT: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def qwen3_vl_8b_config(*, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None) -> Qwen3VLConfig:
    """Qwen3-VL-8B-Instruct's config (see the module docstring); ``vision`` / ``text`` override sub-config fields."""
    text_fields = {**QWEN3_VL_8B_TEXT, **(text or {})}
    text_fields["rope_parameters"] = dict(text_fields["rope_parameters"])
    return Qwen3VLConfig(
        vision_config={**QWEN3_VL_8B_VISION, **(vision or {})},
        text_config=text_fields,
        tie_word_embeddings=False,
        **QWEN2_VL_7B_TOKENS,
    )


def random_model(
    config: Qwen2VLConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> torch.nn.Module:
    """``Qwen2VLForConditionalGeneration`` for ``config`` with random weights (``seed`` seeds torch's global
    generators), built directly on ``device`` in ``dtype`` (no download, no checkpoint), in eval mode without
    gradients. The model gets its own copy of ``config``: routing its attention later (say
    `install_vision_attention`) leaves ``config`` fit to build the next one."""
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(copy.deepcopy(config), dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def random_pixel_inputs(config: Qwen2VLConfig, grids: list[tuple[int, int, int]], seed: int = 0) -> list[PixelInputs]:
    """Random normalised pixel rows for items of these ``(t, h, w)`` patch grids (``h``, ``w`` multiples of
    the spatial merge), shaped as the image processor's output for ``config``'s tower."""
    vision = config.vision_config
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    gen = torch.Generator().manual_seed(seed)
    return [PixelInputs(torch.randn(t * h * w, width, generator=gen), (t, h, w)) for t, h, w in grids]
