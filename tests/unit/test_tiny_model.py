"""Tiny model folders: deterministic, loadable offline by the Auto classes, vocabulary = tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.models.tiny_model import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, make_tiny_model
from tests.conftest import TINY_TEST_MAX_PIXELS

SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def test_build_is_byte_identical_in_a_fresh_process(tiny_model_dir: Path, fresh_tiny_builds: Path) -> None:
    # Another interpreter with another hash seed must produce exactly the session fixture's bytes.
    rebuilt, original = _files(fresh_tiny_builds / "qwen2-vl"), _files(tiny_model_dir)
    assert sorted(rebuilt) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "video_preprocessor_config.json",
    ]
    assert rebuilt == original


def test_llava_build_is_byte_identical_in_a_fresh_process(tiny_llava_dir: Path, fresh_tiny_builds: Path) -> None:
    rebuilt = _files(fresh_tiny_builds / "llava")
    assert sorted(rebuilt) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert rebuilt == _files(tiny_llava_dir)


def test_llava_loads_with_auto_classes_offline(tiny_llava_dir: Path) -> None:
    """Config, tokenizer, CLIP image processor, LlavaProcessor and model load offline; the CLIP keeps LLaVA-1.5's
    336/14 geometry (576 tokens per image); the language model is a Llama with head_dim 16."""
    from tokenizers import Tokenizer
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoProcessor,
        AutoTokenizer,
        LlamaTokenizer,
    )

    config = AutoConfig.from_pretrained(tiny_llava_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    processor = AutoImageProcessor.from_pretrained(tiny_llava_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_llava_dir)
    assert config.model_type == "llava" and type(model).__name__ == config.architectures[0]
    assert (config.text_config.model_type, config.vision_config.model_type) == ("llama", "clip_vision_model")
    assert config.text_config.vocab_size == len(tokenizer) == model.lm_head.out_features
    assert config.text_config.hidden_size // config.text_config.num_attention_heads == 16
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (336, 14)
    assert (config.vision_feature_layer, config.vision_feature_select_strategy) == (-2, "default")
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in ("<unk>", "<s>", "</s>", "<image>", "<pad>")}
    assert [ids["<unk>"], ids["<s>"], ids["</s>"]] == [0, 1, 2]  # Llama's, the byte tokens after them
    assert tokenizer.convert_tokens_to_ids("<0x0A>") == 3 + 10
    assert config.image_token_id == ids["<image>"] == len(tokenizer) - 2
    assert config.text_config.eos_token_id == ids["</s>"] and config.pad_token_id == ids["<pad>"]
    assert type(processor).__name__.removesuffix("Pil") == "CLIPImageProcessor"
    assert processor.size.shortest_edge == 336 and (processor.crop_size.height, processor.crop_size.width) == (336, 336)
    llava_processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    assert type(llava_processor).__name__ == "LlavaProcessor" and llava_processor.patch_size == 14
    # The file's pipeline, transformers' LlamaTokenizer (which rebuilds it from vocab and merges) and the raw
    # tokenizers file agree; `<s>` comes first; byte fallback covers characters outside the vocabulary.
    text = "USER: <image>\nDescribe the picture, please: 42 apples! café ☃ ASSISTANT:"
    raw = Tokenizer.from_file(str(tiny_llava_dir / "tokenizer.json")).encode(text).ids
    assert tokenizer(text)["input_ids"] == raw == LlamaTokenizer.from_pretrained(tiny_llava_dir)(text)["input_ids"]
    assert raw[0] == ids["<s>"] and raw.count(ids["<image>"]) == 1
    assert tokenizer.decode(raw, skip_special_tokens=True) == text.replace("<image>", "")
    conversation = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered == "USER: <image>\nWhat is this? ASSISTANT:"


def test_qwen25_build_is_byte_identical(tiny_model_dir_25: Path, tmp_path: Path) -> None:
    make_tiny_model(tmp_path, "qwen2.5-vl", max_pixels=TINY_TEST_MAX_PIXELS)
    assert _files(tmp_path) == _files(tiny_model_dir_25)


def test_seed_changes_weights_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    make_tiny_model(tmp_path, "qwen2-vl", max_pixels=TINY_TEST_MAX_PIXELS, seed=1)
    other, original = _files(tmp_path), _files(tiny_model_dir)
    assert other["model.safetensors"] != original["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in original.items() if k != "model.safetensors"
    }


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_model_dir_25"])
def test_loads_with_auto_classes_offline(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    folder: Path = request.getfixturevalue(fixture)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    expected_type = "qwen2_vl" if fixture == "tiny_model_dir" else "qwen2_5_vl"
    assert config.model_type == expected_type
    assert type(model).__name__ == config.architectures[0]
    assert config.text_config.vocab_size == len(tokenizer)
    assert model.lm_head.out_features == len(tokenizer)
    assert model.model.get_input_embeddings().num_embeddings == len(tokenizer)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL}
    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.text_config.eos_token_id == ids["<|im_end|>"]
    assert processor.size.shortest_edge == DEFAULT_MIN_PIXELS
    assert processor.size.longest_edge == TINY_TEST_MAX_PIXELS
    head_dim = config.text_config.hidden_size // config.text_config.num_attention_heads
    assert sum(config.text_config.rope_parameters["mrope_section"]) * 2 == head_dim


def test_default_processor_settings_are_saved(tmp_path: Path) -> None:
    make_tiny_model(tmp_path, "qwen2-vl")
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["size"] == {"shortest_edge": 56 * 56, "longest_edge": DEFAULT_MAX_PIXELS}
    assert DEFAULT_MAX_PIXELS == 1280 * 28 * 28
    assert (saved["patch_size"], saved["merge_size"], saved["temporal_patch_size"]) == (14, 2, 2)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    added = {entry["content"]: entry["id"] for entry in tokenizer["added_tokens"]}
    assert generation["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]


def test_tokenizer_special_tokens_and_chat_template(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "Describe the picture, please: 42 apples!\n<|vision_start|><|image_pad|><|vision_end|>  café"
    assert tokenizer(text)["input_ids"] == raw.encode(text).ids
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    for tok in SPECIAL:
        assert tokenizer(tok, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(tok)]
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llava-9"):
        make_tiny_model(tmp_path, "llava-9")
    with pytest.raises(ValueError, match="max_pixels"):
        make_tiny_model(tmp_path, "qwen2-vl", max_pixels=100)
    with pytest.raises(ValueError, match="text_width"):
        make_tiny_model(tmp_path, "qwen2-vl", text_width=100)
    with pytest.raises(ValueError, match="max_pixels"):
        make_tiny_model(tmp_path, "llava", max_pixels=DEFAULT_MAX_PIXELS)


def test_cli_offers_every_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import _parser, main

    args = _parser().parse_args(["make-tiny-model", str(tmp_path), "--family", "llava"])
    assert args.family == "llava"
    assert main(["make-tiny-model", str(tmp_path / "m"), "--family", "llava", "--max-pixels", "100000"]) == 2
    assert "max_pixels applies to the Qwen2-VL families" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "llava"])
def test_a_wider_deeper_model_encodes_and_generates(family: str, tmp_path: Path) -> None:
    """The size options keep the model whole: head_dim, M-RoPE sections and the vision merger follow the width."""
    import torch
    from PIL import Image

    from services.models.registry import load_adapter

    max_pixels = None if family == "llava" else TINY_TEST_MAX_PIXELS
    folder = make_tiny_model(tmp_path, family, max_pixels=max_pixels, text_width=128, text_layers=3)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"]) == (128, 3)
    if family != "llava":  # Llama: 1-D rotary positions
        assert sum(text["rope_parameters"]["mrope_section"]) * 2 == 128 // text["num_attention_heads"]
    adapter = load_adapter(folder)
    model = adapter.load_model()
    pixels = adapter.preprocess(Image.new("RGB", (64, 48), (200, 40, 90)))
    embedding = adapter.encode(model, [pixels])[0]
    assert embedding.shape[-1] == 128 and torch.isfinite(embedding).all()
    out = model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
