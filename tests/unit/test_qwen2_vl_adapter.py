"""Qwen2-VL / Qwen2.5-VL adapter against transformers' own processor, rope index and `generate`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import DynamicCache

from services.models.base import (
    ChatMessage,
    ChatPart,
    ImageSizeError,
    ItemTokens,
    ModelAdapter,
    PlacedEmbedding,
    PromptError,
)
from services.models.media_span import MediaSpan
from services.models.qwen2_vl import Qwen2VLAdapter
from services.models.qwen2_vl_resize import smart_resize
from services.models.registry import load_adapter, model_revision
from tests.oracle import hf_generate

FAMILIES = ["tiny_model_dir", "tiny_model_dir_25"]
SIZES = [
    (1, 1),
    (3, 5),
    (28, 28),
    (57, 41),
    (223, 337),
    (640, 480),
    (1344, 1008),
    (1920, 1080),
    (1080, 1920),
    (4000, 3000),
    (5000, 30),
    (30, 5000),
    (14, 2000),
    (2000, 11),
]


def _with_max_pixels(source: Path, target: Path, max_pixels: int) -> Path:
    """A copy of a model folder's non-weight files whose image processor has another pixel cap."""
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, target / name)
    settings_ = json.loads((source / "preprocessor_config.json").read_text())
    settings_["size"]["longest_edge"] = max_pixels
    (target / "preprocessor_config.json").write_text(json.dumps(settings_))
    return target


def _image(width: int, height: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def _processor_tokens(adapter: Qwen2VLAdapter, width: int, height: int) -> ItemTokens:
    grid = adapter.image_processor(images=[_image(width, height, 0)], return_tensors="pt")["image_grid_thw"][0]
    merge = adapter.image_processor.merge_size
    thw = tuple(int(v) for v in grid.tolist())
    return ItemTokens(int(grid.prod()) // merge**2, thw, thw[1] * 14, thw[2] * 14)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[Qwen2VLAdapter, torch.nn.Module, Path]:
    folder: Path = request.getfixturevalue(request.param)
    adapter = Qwen2VLAdapter.from_folder(folder)
    return adapter, adapter.load_model(), folder


@pytest.mark.parametrize("max_pixels", [256 * 28 * 28, 1280 * 28 * 28])
def test_image_tokens_equal_the_processor(tiny_model_dir: Path, tmp_path: Path, max_pixels: int) -> None:
    adapter = Qwen2VLAdapter.from_folder(_with_max_pixels(tiny_model_dir, tmp_path / "m", max_pixels))
    for width, height in SIZES:
        assert adapter.image_tokens(width, height) == _processor_tokens(adapter, width, height), (width, height)


def test_1344x1008_at_both_caps(tiny_model_dir: Path, tmp_path: Path) -> None:
    capped = Qwen2VLAdapter.from_folder(_with_max_pixels(tiny_model_dir, tmp_path / "a", 1280 * 28 * 28))
    uncapped = Qwen2VLAdapter.from_folder(_with_max_pixels(tiny_model_dir, tmp_path / "b", 10**9))
    assert capped.image_tokens(1344, 1008).num_tokens == 1230
    assert uncapped.image_tokens(1344, 1008).num_tokens == 1728
    assert _processor_tokens(capped, 1344, 1008).num_tokens == 1230
    assert _processor_tokens(uncapped, 1344, 1008).num_tokens == 1728
    assert uncapped.processor_settings()["max_pixels"] == 10**9
    assert capped.processor_settings() != uncapped.processor_settings()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000), st.sampled_from([3136, 200704, 1003520, 10**9]))
def test_smart_resize_equals_transformers(width: int, height: int, max_pixels: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    if max(width, height) / min(width, height) > 200:
        with pytest.raises(ImageSizeError):
            smart_resize(height, width, 28, 3136, max_pixels)
        with pytest.raises(ValueError):
            hf_smart_resize(height, width, 28, 3136, max_pixels)
        return
    assert smart_resize(height, width, 28, 3136, max_pixels) == hf_smart_resize(height, width, 28, 3136, max_pixels)


def test_processor_settings_are_canonical_json(tiny_model_dir: Path) -> None:
    settings_ = Qwen2VLAdapter.from_folder(tiny_model_dir).processor_settings()
    assert json.loads(json.dumps(settings_, sort_keys=True)) == settings_
    assert settings_["min_pixels"] == 56 * 56 and settings_["max_pixels"] == 256 * 28 * 28
    for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "resample"):
        assert key in settings_


def test_build_prompt_spans_cover_the_image_pad_runs(tiny_model_dir: Path) -> None:
    adapter = Qwen2VLAdapter.from_folder(tiny_model_dir)
    tok = adapter.tokenizer
    items = [adapter.image_tokens(640, 480), adapter.image_tokens(100, 300)]
    messages = [
        ChatMessage("system", [ChatPart("text", "Be brief.")]),
        ChatMessage("user", [ChatPart("image"), ChatPart("text", "Compare"), ChatPart("image"), ChatPart("text", ".")]),
    ]
    built = adapter.build_prompt(messages, items)
    assert [span.num_tokens for span in built.spans] == [item.num_tokens for item in items]
    for span in built.spans:
        run = built.token_ids[span.offset : span.offset + span.num_tokens]
        assert run == [adapter.image_token_id] * span.num_tokens
        assert built.token_ids[span.offset - 1] == tok.convert_tokens_to_ids("<|vision_start|>")
        assert built.token_ids[span.offset + span.num_tokens] == tok.convert_tokens_to_ids("<|vision_end|>")
    assert built.token_ids.count(adapter.image_token_id) == built.media_tokens == sum(i.num_tokens for i in items)
    assert built.text_tokens + built.media_tokens == len(built.token_ids)
    assert tok.decode(built.token_ids).endswith("<|vision_end|>.<|im_end|>\n<|im_start|>assistant\n")
    # Same ids as expanding in text, the way Qwen2VLProcessor does.
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "X"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    pads = "<|vision_start|>" + "<|image_pad|>" * items[0].num_tokens + "<|vision_end|>Compare"
    pads += "<|vision_start|>" + "<|image_pad|>" * items[1].num_tokens + "<|vision_end|>."
    assert tok(text.replace("X", pads), add_special_tokens=False)["input_ids"] == built.token_ids


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|im_start|>", "<|vision_end|>", "<|endoftext|>"])
def test_special_token_text_is_rejected(tiny_model_dir: Path, token: str) -> None:
    adapter = Qwen2VLAdapter.from_folder(tiny_model_dir)
    messages = [
        ChatMessage("user", [ChatPart("text", "hello")]),
        ChatMessage("assistant", [ChatPart("text", "hi")]),
        ChatMessage("user", [ChatPart("text", f"look {token} here")]),
    ]
    with pytest.raises(PromptError, match=r"message 2.*" + token.replace("|", r"\|")):
        adapter.build_prompt(messages, [])


def test_item_count_must_match_image_parts(tiny_model_dir: Path) -> None:
    adapter = Qwen2VLAdapter.from_folder(tiny_model_dir)
    messages = [ChatMessage("user", [ChatPart("image"), ChatPart("text", "hi")])]
    with pytest.raises(PromptError, match="1 image parts but 0 items"):
        adapter.build_prompt(messages, [])


def test_batched_encode_equals_one_at_a_time(family: tuple[Qwen2VLAdapter, torch.nn.Module, Path]) -> None:
    adapter, model, _ = family
    inputs = [adapter.preprocess(_image(w, h, i)) for i, (w, h) in enumerate([(300, 200), (64, 400), (500, 500)])]
    batched = adapter.encode(model, inputs)
    for item, rows in zip(inputs, batched, strict=True):
        alone = adapter.encode(model, [item])[0]
        assert rows.shape == alone.shape
        assert torch.allclose(rows, alone, atol=1e-5, rtol=0)
    assert [r.shape[0] for r in batched] == [i.grid_thw[1] * i.grid_thw[2] // 4 for i in inputs]


def _prepared(adapter: Qwen2VLAdapter, model: torch.nn.Module, images: list[Image.Image], messages: list[ChatMessage]):
    items = [adapter.image_tokens(image.width, image.height) for image in images]
    built = adapter.build_prompt(messages, items)
    placed = [MediaSpan("", s.offset, s.num_tokens, i.grid_thw) for s, i in zip(built.spans, items, strict=True)]
    return built, placed


def test_prompt_positions_equal_get_rope_index(family: tuple[Qwen2VLAdapter, torch.nn.Module, Path]) -> None:
    adapter, model, _ = family
    images = [_image(300, 200, 1), _image(120, 260, 2)]
    messages = [ChatMessage("user", [ChatPart("image"), ChatPart("text", "and"), ChatPart("image")])]
    built, placed = _prepared(adapter, model, images, messages)
    ids = torch.tensor([built.token_ids])
    expected, delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == adapter.image_token_id).int(),
        image_grid_thw=torch.tensor([p.grid_thw for p in placed]),
    )
    got = adapter.prompt_positions(model, built.token_ids, placed)
    assert torch.equal(got.positions, expected[:, 0])
    assert got.rope_delta == int(delta) and got.rope_delta < 0
    assert torch.equal(adapter.decode_positions(5, 2, -3), torch.tensor([[2, 3]] * 3))
    text_only = adapter.prompt_positions(model, [1, 2, 3], [])
    assert torch.equal(text_only.positions, torch.arange(3).expand(3, 3)) and text_only.rope_delta == 0
    with pytest.raises(ValueError, match="no item covers"):
        adapter.prompt_positions(model, built.token_ids, placed[:1])
    with pytest.raises(ValueError, match="item 0"):
        adapter.prompt_positions(model, built.token_ids, [replace(placed[0], offset=placed[0].offset - 1)])


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


PROMPTS = [
    [ChatMessage("user", [ChatPart("image"), ChatPart("text", "Describe both pictures."), ChatPart("image")])],
    [
        ChatMessage("system", [ChatPart("text", "Be short.")]),
        ChatMessage(
            "user", [ChatPart("image"), ChatPart("text", "What differs between these two?"), ChatPart("image")]
        ),
    ],
]


@pytest.mark.parametrize("messages", PROMPTS, ids=["user-only", "with-system"])
def test_split_greedy_equals_generate(
    family: tuple[Qwen2VLAdapter, torch.nn.Module, Path], messages: list[ChatMessage]
) -> None:
    adapter, model, folder = family
    images = [_image(300, 200, 3), _image(90, 260, 4)]
    expected = hf_generate(folder, messages, images, 16)
    assert len(expected) == 16
    assert _greedy(adapter, model, images, messages, 16) == expected
    # The comparison is sensitive: one position off during decode changes the output.
    assert _greedy(adapter, model, images, messages, 16, skew=1) != expected


def test_split_greedy_stops_at_eos_like_generate(tiny_model_dir: Path) -> None:
    # With the tiny Qwen2-VL this prompt ends on <|im_end|> after 8 tokens: both paths stop there.
    adapter = Qwen2VLAdapter.from_folder(tiny_model_dir)
    images = [_image(300, 200, 3), _image(90, 260, 4)]
    parts = [ChatPart("image"), ChatPart("text", "What differs between these two?"), ChatPart("image")]
    messages = [ChatMessage("user", parts)]
    expected = hf_generate(tiny_model_dir, messages, images, 16)
    assert len(expected) < 16 and expected[-1] in adapter.eos_token_ids
    assert _greedy(adapter, adapter.load_model(), images, messages, 16) == expected


def test_embed_prompt_rejects_misplaced_rows(family: tuple[Qwen2VLAdapter, torch.nn.Module, Path]) -> None:
    """Rows past the ids are refused; rows over text are not checked here (that reads device values): the
    engine refuses such a request at add_request, from its host-side ids."""
    adapter, model, _ = family
    ids = torch.tensor([5, adapter.image_token_id, adapter.image_token_id, 6])
    rows = torch.ones(2, adapter.hidden_size)
    embedded = adapter.embed_prompt(model, ids, [PlacedEmbedding(1, rows)])
    assert torch.equal(embedded[1:3], rows)
    assert torch.equal(embedded[0], model.model.get_input_embeddings().weight[5])
    with pytest.raises(ValueError, match="outside"):
        adapter.embed_prompt(model, ids, [PlacedEmbedding(3, rows)])


def test_registry_chooses_by_model_type(tiny_model_dir: Path, tiny_model_dir_25: Path, tmp_path: Path) -> None:
    for folder, model_type in ((tiny_model_dir, "qwen2_vl"), (tiny_model_dir_25, "qwen2_5_vl")):
        adapter = load_adapter(folder)
        assert isinstance(adapter, Qwen2VLAdapter) and isinstance(adapter, ModelAdapter)
        assert adapter.model_type == model_type
        assert adapter.eos_token_ids == [
            adapter.tokenizer.convert_tokens_to_ids("<|im_end|>"),
            adapter.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ]
        assert adapter.max_context == 32768
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mystery_vlm"}))
    with pytest.raises(ValueError, match="mystery_vlm"):
        load_adapter(tmp_path)


def test_model_revision_tracks_config_and_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    revision = model_revision(tiny_model_dir)
    assert len(revision) == 64 and int(revision, 16) >= 0
    assert model_revision(copy) == revision
    (copy / "tokenizer_config.json").write_text("{}")
    assert model_revision(copy) == revision
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(weights))
    changed = model_revision(copy)
    assert changed != revision
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert model_revision(copy) not in (revision, changed)
