"""Qwen3-VL video rules against transformers' own processors, `get_rope_index` and `generate`.

The reference (tests/data/video_reference, made by scripts/video_reference.py with transformers 5.24's
Qwen3VLProcessor and Qwen3VLVideoProcessor on the tiny Qwen3-VL folder, where torchvision runs) holds, per stored
video, the sampled frame indices, `video_grid_thw`, the prompt ids (with the timestamp before each frame group)
and the sha256 of `pixel_values_videos`; and indices and grids for header-only cases (some past the per-frame
cap). Equal means bit-equal. Positions are compared with `get_rope_index` (each frame group positioned as an
image, the timestamps between as text), and the split path (one tower call for an image and a video, each frame
group's rows and DeepStack levels placed at its own span) with `generate`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.media_types import VideoLimits
from services.common.video import probe_video
from services.encoder.video_decode import decode_video
from services.models.base import ChatMessage, ChatPart, VideoError
from services.models.media_span import span_items
from services.models.qwen3_vl import Qwen3VLAdapter
from services.models.qwen3_vl_video import sample_frame_indices, video_settings
from services.models.registry import load_adapter
from tests import media_factory
from tests.oracle_video import hf_generate_media, video_config, video_inputs
from tests.split_greedy import split_greedy

REFERENCE = Path(__file__).resolve().parent.parent / "data" / "video_reference"
CASES = json.loads((REFERENCE / "reference.json").read_text())
PROMPT = "What happens in the video?"
FAMILY = "qwen3-vl"


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_vl_dir: Path) -> tuple[Qwen3VLAdapter, torch.nn.Module, Path]:
    adapter = load_adapter(tiny_qwen3_vl_dir)
    assert isinstance(adapter, Qwen3VLAdapter)
    return adapter, adapter.load_model(), tiny_qwen3_vl_dir


def _sha(pixels: torch.Tensor) -> str:
    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).hexdigest()


def _video_prompt(adapter: Qwen3VLAdapter, tokens: Any):
    return adapter.build_prompt([ChatMessage("user", [ChatPart("video"), ChatPart("text", PROMPT)])], [tokens])


@pytest.mark.parametrize("name", sorted(CASES["videos"]))
def test_header_decode_pixels_and_prompt_equal_the_processor(qwen3: tuple, name: str) -> None:
    adapter = qwen3[0]
    entry = CASES["videos"][name]
    data = (REFERENCE / entry["file"]).read_bytes()
    header = probe_video(data, VideoLimits())
    expected = entry[FAMILY]
    tokens = adapter.video_tokens(header.width, header.height, header.frames, header.fps)
    assert list(tokens.frame_indices) == expected["frame_indices"]
    assert list(tokens.grid_thw) == expected["video_grid_thw"]
    plan = adapter.video_frame_plan(tokens.grid_thw, tokens.frame_indices)
    frames, _ = decode_video(data, plan, VideoLimits(), timeout_s=30)
    pixels = adapter.preprocess_video(frames, tokens.grid_thw).pixel_values
    assert list(pixels.shape) == expected["pixel_shape"] and _sha(pixels) == expected["pixel_sha256"]
    built = _video_prompt(adapter, tokens)
    assert built.token_ids == expected["input_ids"]  # timestamps, frame groups and all: the processor's count
    assert built.media_tokens == tokens.num_tokens and len(built.spans) == tokens.grid_thw[0]
    t, h, w = tokens.grid_thw
    group = h * w // 4
    assert [(s.item_row, s.num_tokens, s.grid_thw) for s in built.spans] == [
        (k * group, group, (1, h, w)) for k in range(t)
    ]
    assert span_items(built.spans) == [0] * t


@pytest.mark.parametrize("name", sorted(CASES["videos"]))
def test_the_oracle_equals_the_processor(tiny_qwen3_vl_dir: Path, name: str) -> None:
    entry = CASES["videos"][name]
    expected = entry[FAMILY]
    got = video_inputs((REFERENCE / entry["file"]).read_bytes(), video_config(tiny_qwen3_vl_dir))
    assert got.frame_indices == expected["frame_indices"] and list(got.video_grid_thw) == expected["video_grid_thw"]
    assert _sha(got.pixel_values_videos) == expected["pixel_sha256"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_vl_dir)
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", got.text).replace("<|video-expanded|>", "<|video_pad|>")
    assert tokenizer(text)["input_ids"] == expected["input_ids"]


def test_header_only_counts_equal_the_processor(qwen3: tuple) -> None:
    adapter = qwen3[0]
    capped = 0
    for key, case in CASES["headers"].items():
        width, height, total, fps = case["header"]
        tokens = adapter.video_tokens(width, height, total, fps)
        expected = case[FAMILY]
        assert list(tokens.frame_indices) == expected["frame_indices"], key
        assert list(tokens.grid_thw) == expected["video_grid_thw"], key
        assert tokens.num_tokens == tokens.grid_thw[0] * tokens.grid_thw[1] * tokens.grid_thw[2] // 4
        capped += len(tokens.frame_indices) >= 6  # the per-frame floor, not the clip's budget, sets the size
    assert capped


def test_sampling_rule_invariants(qwen3: tuple) -> None:
    """Frames within the video, strictly increasing, the first and last frame taken, as many as the rule asks."""
    settings = qwen3[0].video_settings
    for total in range(2, 400, 7):
        for fps in (1.0, 10.0, 23.976, 30.0, 60.0):
            sampled = sample_frame_indices(total, fps, settings)
            assert list(sampled) == sorted(set(sampled)) and sampled[0] == 0 and sampled[-1] == total - 1
            assert len(sampled) == min(max(int(total / fps * 2), 4), total)
    with pytest.raises(VideoError, match="at least 2 frames"):
        sample_frame_indices(1, 30.0, settings)
    assert video_settings({}).min_pixels == 128 * 32 * 32 and video_settings({}).image_mean == (0.5, 0.5, 0.5)


def _mixed(adapter: Qwen3VLAdapter, video: bytes):
    """A prompt with an image, a video and text; its messages, built prompt and items."""
    header = probe_video(video, VideoLimits())
    items = [adapter.image_tokens(90, 60), adapter.video_tokens(header.width, header.height, header.frames, header.fps)]
    messages = [
        ChatMessage("user", [ChatPart("image"), ChatPart("text", "then"), ChatPart("video"), ChatPart("text", PROMPT)])
    ]
    return messages, adapter.build_prompt(messages, items), items


@pytest.mark.parametrize("fps", [8, 15, 30])
def test_video_positions_equal_get_rope_index(qwen3: tuple, fps: int) -> None:
    adapter, model, _ = qwen3
    _, built, items = _mixed(adapter, media_factory.video(97, 61, seconds=2.1, fps=fps, seed=fps))
    ids = torch.tensor([built.token_ids])
    types = (ids == adapter.image_token_id).int() + 2 * (ids == adapter.video_token_id).int()
    expected, delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor([items[0].grid_thw]),
        video_grid_thw=torch.tensor([items[1].grid_thw]),
    )
    got = adapter.prompt_positions(None, built.token_ids, built.spans)
    assert torch.equal(got.positions, expected[:, 0]) and got.rope_delta == int(delta)
    assert len(built.spans) == 1 + items[1].grid_thw[0] and span_items(built.spans) == [0] + [1] * items[1].grid_thw[0]


def test_split_path_with_video_equals_generate(qwen3: tuple) -> None:
    """encode (image and video in one tower call), embed, positions, DeepStack, prefill whole and in 7-row chunks
    (which split frame groups and timestamps), decode == `generate` greedy."""
    adapter, model, folder = qwen3
    video = media_factory.video(75, 133, seconds=1.4, fps=10, container="webm", seed=3)
    image = media_factory.image(90, 60, seed=4)
    messages, built, items = _mixed(adapter, video)
    plan = adapter.video_frame_plan(items[1].grid_thw, items[1].frame_indices)
    frames, _ = decode_video(video, plan, VideoLimits(), timeout_s=30)
    rows = adapter.encode(model, [adapter.preprocess(image), adapter.preprocess_video(frames, items[1].grid_thw)])
    assert rows[1].shape == (items[1].num_tokens, adapter.embedding_width)
    expected = hf_generate_media(folder, messages, [image, video], 10)
    assert len(expected) == 10
    assert split_greedy(adapter, model, built, rows, 10, chunk=10_000) == expected
    assert split_greedy(adapter, model, built, rows, 10, chunk=7) == expected
