"""Qwen3-VL's adapter against transformers: token counts, prompt ids, positions, DeepStack encode and the split path.

The tiny folder (`epd make-tiny-model --family qwen3-vl`) is transformers' own Qwen3VLForConditionalGeneration with
two DeepStack levels. Token counts equal Qwen2VLImageProcessor's (16-pixel patches, 2x2 merge) at the test cap and
the released one; `encode` is `get_image_features`' pooler output and each DeepStack feature, joined; positions
equal `get_rope_index`; the split path (encode, embed, positions, DeepStack keywords, prefill whole or in chunks that
split the images, decode) equals `generate` greedy, and leaving the levels out changes the answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from services.common.hashing import ModelIdentity, mm_hash
from services.models import deepstack
from services.models.base import (
    ChatMessage,
    ChatPart,
    ModelAdapter,
    PlacedEmbedding,
    placeholder_token_id,
    supports_video,
)
from services.models.media_span import MediaSpan
from services.models.qwen3_vl import Qwen3VLAdapter
from services.models.registry import load_adapter
from tests.conftest import TINY_QWEN3_MAX_PIXELS
from tests.oracle import hf_generate
from tests.split_greedy import split_greedy

SIZES = [(1, 1), (3, 5), (32, 32), (57, 41), (223, 337), (640, 480), (1344, 1008), (1920, 1080), (30, 5000)]
MESSAGES = [ChatMessage("user", [ChatPart("image"), ChatPart("text", "Describe both pictures."), ChatPart("image")])]


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_vl_dir: Path) -> tuple[Qwen3VLAdapter, torch.nn.Module, Path]:
    adapter = load_adapter(tiny_qwen3_vl_dir)
    assert isinstance(adapter, Qwen3VLAdapter)
    return adapter, adapter.load_model(), tiny_qwen3_vl_dir


def _image(width: int, height: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def test_tiny_folder_is_byte_identical_in_a_fresh_process(tiny_qwen3_vl_dir: Path, fresh_tiny_builds: Path) -> None:
    assert _files(fresh_tiny_builds / "qwen3-vl") == _files(tiny_qwen3_vl_dir)


def test_tiny_folder_is_transformers_qwen3_vl(qwen3: tuple[Qwen3VLAdapter, torch.nn.Module, Path]) -> None:
    adapter, model, folder = qwen3
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim, text.num_key_value_heads) == (64, 2, 16, 2)
    assert text.rope_parameters["mrope_interleaved"] is True
    assert (vision.patch_size, vision.spatial_merge_size, list(vision.deepstack_visual_indexes)) == (16, 2, [0, 1])
    assert adapter.vocab_size == len(adapter.tokenizer) == model.lm_head.out_features
    assert (adapter.deepstack_levels, adapter.embedding_width) == (2, 3 * 64)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and isinstance(adapter, ModelAdapter)


@pytest.mark.parametrize("max_pixels", [TINY_QWEN3_MAX_PIXELS, 16384 * 32 * 32])
def test_image_tokens_equal_the_processor(tiny_qwen3_vl_dir: Path, tmp_path: Path, max_pixels: int) -> None:
    folder = tmp_path / "copy"
    folder.mkdir()
    for path in tiny_qwen3_vl_dir.iterdir():
        if path.suffix == ".json":
            (folder / path.name).write_bytes(path.read_bytes())
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    settings["size"]["longest_edge"] = max_pixels
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    adapter = Qwen3VLAdapter.from_folder(folder)
    for width, height in SIZES:
        grid = adapter.image_processor(images=[_image(width, height, 0)], return_tensors="pt")["image_grid_thw"][0]
        ours = adapter.image_tokens(width, height)
        assert ours.grid_thw == tuple(int(v) for v in grid) and ours.num_tokens == int(grid.prod()) // 4, (
            width,
            height,
        )
        assert (ours.resized_height, ours.resized_width) == (grid[1] * 16, grid[2] * 16)


def test_prompt_ids_equal_the_template_and_processor_expansion(qwen3: tuple[Qwen3VLAdapter, Any, Path]) -> None:
    adapter, _, _ = qwen3
    images = [_image(300, 200, 1), _image(64, 400, 2)]
    items = [adapter.image_tokens(im.width, im.height) for im in images]
    built = adapter.build_prompt(MESSAGES, items)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe both pictures."},
                                                 {"type": "image"}]}]  # fmt: skip
    text = adapter.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>")  # no default system turn
    for item in items:  # as Qwen3VLProcessor.replace_image_token expands each placeholder
        text = text.replace("<|image_pad|>", "<|placeholder|>" * item.num_tokens, 1)
    expected = adapter.tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]
    assert built.token_ids == expected
    assert [s.num_tokens for s in built.spans] == [i.num_tokens for i in items]


def test_settings_name_the_layout_so_hashes_differ_from_qwen2_vl(
    qwen3: tuple[Qwen3VLAdapter, Any, Path], tiny_model_dir: Path
) -> None:
    adapter, _, _ = qwen3
    settings = adapter.processor_settings()
    assert (settings["embedding_layout"], settings["deepstack_levels"]) == (deepstack.LAYOUT, 2)
    qwen2 = load_adapter(tiny_model_dir)
    assert qwen2.hidden_size == adapter.hidden_size and qwen2.embedding_width == qwen2.hidden_size
    data = b"the same image bytes"
    # even under one model id and revision, the layout alone keeps the two families' items apart
    ours = mm_hash(ModelIdentity("m", "r", settings), "image", data)
    theirs = mm_hash(ModelIdentity("m", "r", qwen2.processor_settings()), "image", data)
    one_level = mm_hash(ModelIdentity("m", "r", {**settings, "deepstack_levels": 1}), "image", data)
    assert len({ours, theirs, one_level}) == 3


def test_encode_is_the_towers_main_and_deepstack_features(qwen3: tuple[Qwen3VLAdapter, Any, Path]) -> None:
    adapter, model, _ = qwen3
    inputs = [adapter.preprocess(_image(w, h, i)) for i, (w, h) in enumerate([(300, 200), (64, 400), (500, 500)])]
    batched = adapter.encode(model, inputs)
    with torch.no_grad():
        out = model.model.get_image_features(
            torch.cat([i.pixel_values for i in inputs]), torch.tensor([i.grid_thw for i in inputs])
        )
    hidden = adapter.hidden_size
    for index, (item, rows) in enumerate(zip(inputs, batched, strict=True)):
        assert rows.shape == (item.grid_thw[1] * item.grid_thw[2] // 4, 3 * hidden)
        assert torch.allclose(deepstack.main_rows(rows, hidden), out.pooler_output[index], atol=1e-5, rtol=0)
        for level in range(2):
            want = out.deepstack_features[level][index]
            assert torch.allclose(deepstack.level_rows(rows, hidden, level), want, atol=1e-5, rtol=0)
        alone = adapter.encode(model, [item])[0]
        assert torch.allclose(rows, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(deepstack.level_rows(batched[0], hidden, 0), deepstack.level_rows(batched[0], hidden, 1))


def test_prompt_positions_equal_get_rope_index(qwen3: tuple[Qwen3VLAdapter, Any, Path]) -> None:
    adapter, model, _ = qwen3
    images = [_image(300, 200, 1), _image(120, 260, 2)]
    items = [adapter.image_tokens(im.width, im.height) for im in images]
    built = adapter.build_prompt(MESSAGES, items)
    spans = [MediaSpan("", s.offset, s.num_tokens, i.grid_thw) for s, i in zip(built.spans, items, strict=True)]
    ids = torch.tensor([built.token_ids])
    expected, delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == adapter.image_token_id).int(),
        image_grid_thw=torch.tensor([s.grid_thw for s in spans]),
    )
    got = adapter.prompt_positions(model, built.token_ids, spans)
    assert torch.equal(got.positions, expected[:, 0]) and got.rope_delta == int(delta) < 0


def test_deepstack_keywords_cover_exactly_the_placed_rows() -> None:
    hidden = 4
    a = torch.arange(2 * 12, dtype=torch.float32).view(2, 12)  # 2 rows: main, level 0, level 1
    b = -torch.arange(3 * 12, dtype=torch.float32).view(3, 12)
    kwargs = deepstack.step_inputs([PlacedEmbedding(6, b), PlacedEmbedding(1, a)], 10, hidden, 2)
    assert kwargs["visual_pos_masks"].tolist() == [[False, True, True, False, False, False, True, True, True, False]]
    level1 = kwargs["deepstack_visual_embeds"][1]
    assert torch.equal(level1, torch.cat([a[:, 8:12], b[:, 8:12]]))  # row order, level 1's columns
    assert (
        deepstack.step_inputs([], 10, hidden, 2) == {} and deepstack.step_inputs([PlacedEmbedding(0, a)], 3, 4, 0) == {}
    )


def _split_greedy(
    adapter: Qwen3VLAdapter, model: Any, images: list[Image.Image], max_tokens: int, chunk: int, levels: bool = True
) -> list[int]:
    """`split_greedy` over `images` in MESSAGES."""
    built = adapter.build_prompt(MESSAGES, [adapter.image_tokens(im.width, im.height) for im in images])
    rows = adapter.encode(model, [adapter.preprocess(im) for im in images])
    return split_greedy(adapter, model, built, rows, max_tokens, chunk, levels)


def test_split_greedy_equals_generate_whole_and_chunked(qwen3: tuple[Qwen3VLAdapter, Any, Path]) -> None:
    adapter, model, folder = qwen3
    images = [_image(300, 200, 3), _image(90, 260, 4)]
    expected = hf_generate(folder, MESSAGES, images, 16)
    assert len(expected) == 16
    assert _split_greedy(adapter, model, images, 16, chunk=10_000) == expected
    assert _split_greedy(adapter, model, images, 16, chunk=7) == expected  # chunks split both images
    assert _split_greedy(adapter, model, images, 16, chunk=10_000, levels=False) != expected  # the levels count


def test_video_is_taken_with_its_own_settings(qwen3: tuple[Qwen3VLAdapter, Any, Path], tiny_model_dir: Path) -> None:
    """A `VideoAdapter` (tests/unit/test_qwen3_vl_video.py proves its rules), whose video settings are
    Qwen3VLVideoProcessor's and enter the hash."""
    adapter, _, _ = qwen3
    assert supports_video(adapter) and supports_video(load_adapter(tiny_model_dir))
    assert placeholder_token_id(adapter, "image") == adapter.image_token_id
    assert placeholder_token_id(adapter, "video") == adapter.video_token_id
    video = adapter.processor_settings()["video"]
    assert (video["patch_size"], video["image_mean"], video["cap_pixels_per_frame"]) == (16, [0.5] * 3, True)


def test_encode_through_get_image_features_when_the_tower_takes_no_plan(
    qwen3: tuple[Qwen3VLAdapter, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tower that derives its inputs itself (an older transformers) goes through `get_image_features`: the same
    joined rows, every level included."""
    from services.models import qwen3_vl

    adapter, model, _ = qwen3
    inputs = [adapter.preprocess(_image(w, h, i)) for i, (w, h) in enumerate([(300, 200), (64, 400)])]
    planned = adapter.encode(model, inputs)
    monkeypatch.setattr(qwen3_vl, "tower_takes_plan", lambda tower_type: False)
    derived = adapter.encode(model, inputs)
    for a, b in zip(planned, derived, strict=True):
        assert a.shape == b.shape == (a.shape[0], 3 * adapter.hidden_size)
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
