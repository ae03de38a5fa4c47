"""Qwen2-VL-7B's shape as an in-memory config, and a shrunken copy that builds a model whose tower encodes.

services/models/shapes.py: the released numbers, and a random-weight model from the shrunken config through the
adapter's `encode` on both attention paths.
"""

from __future__ import annotations

import pytest
import torch

from services.models.loading import load_folder_parts
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.shapes import qwen2_vl_7b_config, random_model, random_pixel_inputs
from services.models.vision_attention import install_vision_attention

SMALL_VISION = {"depth": 2, "embed_dim": 64, "num_heads": 4, "hidden_size": 128}
SMALL_TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
}


def test_the_7b_config_has_the_released_numbers() -> None:
    config = qwen2_vl_7b_config()
    vision, text = config.vision_config, config.text_config
    assert config.model_type == "qwen2_vl" and vision.model_type == "qwen2_vl_vision"
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.mlp_ratio) == (32, 1280, 16, 4)
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)
    assert vision.hidden_size == 3584 and vision.hidden_act == "quick_gelu" and vision.in_channels == 3
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        3584, 28, 28, 4,
    )  # fmt: skip
    assert (text.intermediate_size, text.vocab_size) == (18944, 152064)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert text.layer_types == ["full_attention"] * 28 and not config.tie_word_embeddings
    assert (config.image_token_id, config.vision_start_token_id) == (151655, 151652)
    assert qwen2_vl_7b_config(text_layers=2).text_config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="text_layers"):
        qwen2_vl_7b_config(text_layers=0)


@pytest.mark.parametrize("mode", ["sdpa", "varlen"])
def test_a_shrunken_7b_shape_builds_and_encodes(tiny_model_dir, mode: str) -> None:
    config = qwen2_vl_7b_config(text_layers=1, vision=SMALL_VISION, text=SMALL_TEXT)
    model = random_model(config, device="cpu", dtype=torch.float32)
    assert install_vision_attention(model, mode) == mode
    parts = load_folder_parts(tiny_model_dir)  # tokenizer and processor only: the weights are the random ones
    adapter = Qwen2VLAdapter(parts.model_dir, config, parts.tokenizer, parts.image_processor, parts.eos_token_ids)
    grids = [(1, 4, 6), (1, 8, 8), (2, 4, 4)]
    out = adapter.encode(model, random_pixel_inputs(config, grids))
    assert [tuple(e.shape) for e in out] == [(6, 128), (16, 128), (8, 128)]
    assert all(torch.isfinite(e).all() for e in out)
    again = random_model(config, device="cpu", dtype=torch.float32)  # same seed, same weights
    pairs = zip(model.state_dict().items(), again.state_dict().items(), strict=True)
    assert all(name == other and torch.equal(a, b) for (name, a), (other, b) in pairs)
