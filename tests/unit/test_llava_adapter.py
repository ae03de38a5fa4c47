"""LLaVA-1.5 adapter against transformers' own LlavaProcessor, image features and `generate`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, DynamicCache

from services.models.base import (
    ChatMessage,
    ChatPart,
    ImageSizeError,
    ModelAdapter,
    PlacedEmbedding,
    PromptError,
)
from services.models.llava import LlavaAdapter
from services.models.media_span import MediaSpan
from services.models.registry import load_adapter
from services.models.vision_attention import choose_mode, install_vision_attention
from services.models.vision_runner import VisionRunner
from tests import media_factory
from tests.oracle import hf_generate

SIZES = [(1, 1), (3, 5), (28, 28), (57, 41), (223, 337), (336, 336), (640, 480), (1344, 1008), (1080, 1920)]
SIZES += [(5000, 30), (14, 2000)]


def _image(width: int, height: int, seed: int) -> Image.Image:
    return media_factory.image(width, height, seed=seed)


def _variant(source: Path, target: Path, config: dict[str, Any] | None = None, **processor: Any) -> Path:
    """A copy of a model folder with some config.json and preprocessor_config.json keys replaced."""
    shutil.copytree(source, target)
    for name, changes in (("config.json", config or {}), ("preprocessor_config.json", processor)):
        settings_ = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps({**settings_, **changes}))
    return target


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [
        {
            "role": m.role,
            "content": [{"type": "image"} if p.kind == "image" else {"type": "text", "text": p.text} for p in m.parts],
        }
        for m in messages
    ]


@pytest.fixture(scope="module")
def llava(tiny_llava_dir: Path) -> tuple[LlavaAdapter, torch.nn.Module]:
    adapter = LlavaAdapter.from_folder(tiny_llava_dir)
    return adapter, adapter.load_model()


def test_every_image_is_576_tokens_as_the_processor_counts(tiny_llava_dir: Path) -> None:
    adapter = LlavaAdapter.from_folder(tiny_llava_dir)
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    for width, height in SIZES:
        tokens = adapter.image_tokens(width, height)
        assert tokens.num_tokens == 576 and tokens.grid_thw == (1, 24, 24), (width, height)
        assert (tokens.resized_height, tokens.resized_width) == (336, 336)
        encoded = processor(images=[_image(width, height, 0)], text="<image>", return_tensors="pt")
        assert int((encoded["input_ids"] == adapter.image_token_id).sum()) == tokens.num_tokens, (width, height)
        assert tuple(encoded["pixel_values"].shape) == (1, 3, 336, 336)
    for width, height in [(0, 10), (10, 0), (1, 201), (4020, 20)]:
        with pytest.raises(ImageSizeError):
            adapter.image_tokens(width, height)


def test_processor_settings_cover_clip_and_pad(tiny_llava_dir: Path, tmp_path: Path) -> None:
    settings_ = LlavaAdapter.from_folder(tiny_llava_dir).processor_settings()
    assert json.loads(json.dumps(settings_, sort_keys=True)) == settings_
    assert settings_["image_processor_type"] == "CLIPImageProcessor"
    assert settings_["size"] == {"shortest_edge": 336} and settings_["crop_size"] == {"height": 336, "width": 336}
    assert settings_["do_center_crop"] and not settings_["do_pad"] and settings_["resample"] == 3
    # The original LLaVA-1.5 pads to square: LlavaImageProcessor's do_pad, honoured when a folder saves it.
    padded = LlavaAdapter.from_folder(
        _variant(tiny_llava_dir, tmp_path / "pad", image_processor_type="LlavaImageProcessor", do_pad=True)
    )
    assert padded.processor_settings()["do_pad"] and padded.processor_settings() != settings_
    image = _image(300, 120, 1)
    expected = padded.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert torch.equal(padded.preprocess(image).pixel_values, expected)
    unpadded = LlavaAdapter.from_folder(tiny_llava_dir).preprocess(image).pixel_values
    assert not torch.equal(unpadded, expected)
    with pytest.raises(ValueError, match="tower takes 336"):
        LlavaAdapter.from_folder(_variant(tiny_llava_dir, tmp_path / "crop", crop_size={"height": 224, "width": 224}))


PROMPTS = {
    "one-image": [ChatMessage("user", [ChatPart("image"), ChatPart("text", "What is shown here?")])],
    "text-first": [
        ChatMessage(
            "user", [ChatPart("text", "Compare"), ChatPart("image"), ChatPart("text", "and"), ChatPart("image")]
        )
    ],
    "multi-turn": [
        ChatMessage("system", [ChatPart("text", "Be brief.")]),
        ChatMessage("user", [ChatPart("image"), ChatPart("text", "Describe it.")]),
        ChatMessage("assistant", [ChatPart("text", "A picture.")]),
        ChatMessage("user", [ChatPart("text", "And this one?"), ChatPart("image")]),
    ],
    "text-only": [ChatMessage("user", [ChatPart("text", "Hello there, how are you?")])],
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_equals_llava_processor(tiny_llava_dir: Path, name: str) -> None:
    """Our ids equal LlavaProcessor's (built from the folder: tokenizer, CLIPImageProcessor, processor_config)
    on the text the chat template renders: `<s>` first, each `<image>` expanded to 576 in place."""
    adapter = LlavaAdapter.from_folder(tiny_llava_dir)
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    messages = PROMPTS[name]
    images = [_image(200 + 40 * i, 150, i) for i in range(sum(p.kind == "image" for m in messages for p in m.parts))]
    built = adapter.build_prompt(messages, [adapter.image_tokens(im.width, im.height) for im in images])
    text = processor.tokenizer.apply_chat_template(_conversation(messages), tokenize=False, add_generation_prompt=True)
    assert text.endswith("ASSISTANT:") and (not images or "<image>\n" in text)
    encoded = processor(images=images or None, text=text, return_tensors="pt")
    assert encoded["input_ids"][0].tolist() == built.token_ids
    assert built.token_ids[0] == processor.tokenizer.bos_token_id
    assert [span.num_tokens for span in built.spans] == [576] * len(images)
    for span in built.spans:
        assert built.token_ids[span.offset : span.offset + 576] == [adapter.image_token_id] * 576
    assert built.media_tokens == 576 * len(images) and built.text_tokens + built.media_tokens == len(built.token_ids)


@pytest.mark.parametrize("token", ["<image>", "<s>", "</s>", "<pad>"])
def test_special_token_text_and_other_media_are_rejected(tiny_llava_dir: Path, token: str) -> None:
    adapter = LlavaAdapter.from_folder(tiny_llava_dir)
    messages = [ChatMessage("user", [ChatPart("text", "hi")]), ChatMessage("user", [ChatPart("text", f"a {token}")])]
    with pytest.raises(PromptError, match=r"message 1.*" + token):
        adapter.build_prompt(messages, [])
    with pytest.raises(PromptError, match="1 image parts but 0 items"):
        adapter.build_prompt([ChatMessage("user", [ChatPart("image")])], [])
    video = ChatPart("video")  # type: ignore[arg-type]
    with pytest.raises(PromptError, match="video part"):
        adapter.build_prompt([ChatMessage("user", [video])], [])


def test_encode_equals_the_models_image_features(llava: tuple[LlavaAdapter, torch.nn.Module]) -> None:
    """What `generate` places: `get_image_features` on the processor's pixels; one batch equals each alone."""
    adapter, model = llava
    images = [_image(300, 200, 1), _image(64, 400, 2), _image(500, 500, 3)]
    inputs = [adapter.preprocess(image) for image in images]
    batched = adapter.encode(model, inputs)
    pixels = adapter.image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixels).pooler_output
    for rows, want, item in zip(batched, expected, inputs, strict=True):
        assert rows.shape == (576, adapter.hidden_size)
        assert torch.equal(rows, want)
        assert torch.allclose(adapter.encode(model, [item])[0], rows, atol=1e-5, rtol=0)
    assert not torch.allclose(batched[0], batched[1])


@pytest.mark.parametrize("change", [{"vision_feature_layer": -1}, {"vision_feature_select_strategy": "full"}])
def test_feature_layer_and_strategy_are_honoured(tiny_llava_dir: Path, tmp_path: Path, change: dict) -> None:
    default = LlavaAdapter.from_folder(tiny_llava_dir)
    adapter = LlavaAdapter.from_folder(_variant(tiny_llava_dir, tmp_path / "v", change))
    model = adapter.load_model()
    image = _image(200, 300, 4)
    rows = adapter.encode(model, [adapter.preprocess(image)])[0]
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=adapter.preprocess(image).pixel_values).pooler_output[0]
    assert torch.equal(rows, expected)
    full = change.get("vision_feature_select_strategy") == "full"
    assert adapter.image_tokens(10, 10).num_tokens == rows.shape[0] == (577 if full else 576)
    baseline = default.encode(default.load_model(), [default.preprocess(image)])[0]
    if full:  # the same patch rows, with the CLS row in front
        assert torch.equal(rows[1:], baseline)
    else:
        assert not torch.allclose(rows, baseline)


def test_positions_are_the_token_index_on_three_rows(llava: tuple[LlavaAdapter, torch.nn.Module]) -> None:
    adapter, model = llava
    messages = PROMPTS["text-first"]
    items = [adapter.image_tokens(50, 60)] * 2
    built = adapter.build_prompt(messages, items)
    placed = [MediaSpan("", s.offset, s.num_tokens, i.grid_thw) for s, i in zip(built.spans, items, strict=True)]
    got = adapter.prompt_positions(model, built.token_ids, placed)
    assert got.rope_delta == 0
    assert torch.equal(got.positions, torch.arange(len(built.token_ids)).expand(3, -1))
    assert torch.equal(adapter.decode_positions(7, 2, 0), torch.tensor([[7, 8]] * 3))
    with pytest.raises(ValueError, match="no item covers"):
        adapter.prompt_positions(None, built.token_ids, placed[:1])
    with pytest.raises(ValueError, match="item 1"):
        adapter.prompt_positions(None, built.token_ids, [placed[0], replace(placed[1], offset=placed[1].offset + 1)])


def _greedy(adapter: ModelAdapter, model: torch.nn.Module, images, messages, max_tokens: int, skew: int = 0):
    """Our split path: encode, embed, positions, prefill, then decode one token at a time."""
    items = [adapter.image_tokens(image.width, image.height) for image in images]
    built = adapter.build_prompt(messages, items)
    rows = adapter.encode(model, [adapter.preprocess(image) for image in images])
    placed_rows = [PlacedEmbedding(s.offset, r) for s, r in zip(built.spans, rows, strict=True)]
    embeds = adapter.embed_prompt(model, torch.tensor(built.token_ids), placed_rows)
    placed = [MediaSpan("", s.offset, s.num_tokens, i.grid_thw) for s, i in zip(built.spans, items, strict=True)]
    positions = adapter.prompt_positions(model, built.token_ids, placed)
    cache = DynamicCache(config=model.config.get_text_config())
    out: list[int] = []
    with torch.no_grad():
        hidden = adapter.forward_hidden(model, embeds[None], positions.positions[:, None, :], cache=cache)
        while True:
            token = int(adapter.compute_logits(model, hidden[:, -1]).argmax(-1))
            out.append(token)
            if token in adapter.eos_token_ids or len(out) == max_tokens:
                return out
            index = len(built.token_ids) + len(out) - 1
            step = adapter.embed_prompt(model, torch.tensor([token]), [])
            pos = adapter.decode_positions(index, 1, positions.rope_delta + skew)
            hidden = adapter.forward_hidden(model, step[None], pos[:, None, :], cache=cache)


@pytest.mark.parametrize("name", ["one-image", "text-first", "multi-turn"])
def test_split_greedy_equals_generate(llava: tuple[LlavaAdapter, torch.nn.Module], tiny_llava_dir: Path, name: str):
    adapter, model = llava
    messages = PROMPTS[name]
    count = sum(p.kind == "image" for m in messages for p in m.parts)
    images = [_image(300, 200, 3), _image(90, 260, 4)][:count]
    expected = hf_generate(tiny_llava_dir, messages, images, 16)
    assert len(expected) == 16
    assert _greedy(adapter, model, images, messages, 16) == expected
    assert _greedy(adapter, model, images, messages, 16, skew=1) != expected  # one position off shows


def test_embed_prompt_rejects_misplaced_rows(llava: tuple[LlavaAdapter, torch.nn.Module]) -> None:
    adapter, model = llava
    ids = torch.tensor([5, adapter.image_token_id, adapter.image_token_id, 6])
    rows = torch.ones(2, adapter.hidden_size)
    embedded = adapter.embed_prompt(model, ids, [PlacedEmbedding(1, rows)])
    assert torch.equal(embedded[1:3], rows)
    assert torch.equal(embedded[0], model.model.get_input_embeddings().weight[5])
    with pytest.raises(ValueError, match="outside"):
        adapter.embed_prompt(model, ids, [PlacedEmbedding(3, rows)])


def test_registry_and_vision_attention_choice(tiny_llava_dir: Path) -> None:
    adapter = load_adapter(tiny_llava_dir)
    assert isinstance(adapter, LlavaAdapter) and isinstance(adapter, ModelAdapter)
    assert adapter.model_type == "llava" and adapter.max_context == 4096
    assert adapter.eos_token_ids == [adapter.tokenizer.convert_tokens_to_ids("</s>")]
    assert adapter.image_token_id == adapter.tokenizer.convert_tokens_to_ids("<image>")
    model = adapter.load_model()
    assert not adapter.packed_vision_attention  # CLIP has no packed varlen path
    assert LlavaAdapter.from_config(model.config).tokens_per_image == 576
    # Where `auto` would take the varlen kernel (CUDA, bf16), a tower without the packed path keeps sdpa.
    assert choose_mode("auto", torch.device("cuda"), torch.bfloat16, packed=False) == "sdpa"
    with pytest.raises(ValueError, match="no packed varlen"):
        install_vision_attention(model, "varlen", packed=False)
    runner = VisionRunner(adapter, model, attention="auto")
    assert runner.attention == "sdpa" and model.config.vision_config._attn_implementation == "sdpa"
    image = _image(120, 90, 5)
    assert torch.equal(runner.encode([image]).embeddings[0], adapter.encode(model, [adapter.preprocess(image)])[0])
