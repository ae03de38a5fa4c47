"""Correctness oracle for video: transformers' greedy `generate` given the model's own video preprocessing.

transformers' `Qwen2VLVideoProcessor` needs torchvision, which cannot run beside this project's torch, so its
steps are written out here, independently of services/models (tests/unit/test_qwen2_vl_video.py proves this
transcription equal to the real processor on outputs stored by scripts/video_reference.py):

- decode: transformers' own `read_video_pyav` where the header counts frames (MP4); a WebM header counts
  none, so there every frame goes through the same `to_ndarray(format="rgb24")` and the decoded count;
- `sample_frames`, `smart_resize` with the per-frame cap, torchvision's uint8 antialiased bicubic resize
  (`interpolate`), the fused rescale-normalise and `patchify`, from the folder's saved video settings;
- Qwen2.5-VL's `second_per_grid_ts = temporal_patch_size / sampled_fps` as a float32 tensor;
- placeholders expanded in text, `mm_token_type_ids` 1 for image and 2 for video tokens, then
  `model.generate(do_sample=False)`.

Qwen3-VL's `Qwen3VLVideoProcessor` likewise (tests/unit/test_qwen3_vl_video.py proves it on the same stored
outputs): its `sample_frames` (`linspace(0, frames - 1, int(frames / fps x 2)).round()`), transformers' own
video `smart_resize` over the whole clip (with its per-frame cap), the same resize, normalise and patchify; and
`Qwen3VLProcessor`'s text: each video placeholder becomes, per temporal patch, `<t seconds><|vision_start|>` +
the frame's pads + `<|vision_end|>`, the seconds from `_calculate_timestamps` itself.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from services.models.base import ChatMessage
from tests.oracle import _load

_DEFAULTS = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "min_frames": 4,
    "max_frames": 768,
    "cap_pixels_per_frame": False,
    "max_video_tokens": 128000,
    "fps": 2.0,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


@dataclass(frozen=True)
class VideoInputs:
    """What the processor gives `generate` for one video."""

    pixel_values_videos: torch.Tensor
    video_grid_thw: tuple[int, int, int]
    second_per_grid_t: torch.Tensor  # float32 scalar
    frame_indices: list[int]
    text: str = ""  # Qwen3-VL: what the video's placeholder becomes in the prompt text (timestamps and frames)


_QWEN3_DEFAULTS = {
    **_DEFAULTS,
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
    "max_video_tokens": 768,
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def video_config(model_dir: Path) -> dict[str, Any]:
    saved = json.loads((Path(model_dir) / "video_preprocessor_config.json").read_text())
    qwen3 = saved.get("video_processor_type") == "Qwen3VLVideoProcessor"
    return {**(_QWEN3_DEFAULTS if qwen3 else _DEFAULTS), **saved, "qwen3": qwen3}


def decoded(data: bytes, config: dict[str, Any]) -> tuple[np.ndarray, list[int], float, int]:
    """The sampled rgb24 frames, their indices, the stream's fps and its frame count."""
    import av
    from transformers.video_utils import read_video_pyav

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        header_frames, fps = int(stream.frames), float(stream.average_rate)
    if header_frames:
        frames, metadata = read_video_pyav(io.BytesIO(data), lambda metadata: sample(metadata, config))
        return frames, [int(i) for i in metadata.frames_indices], fps, header_frames
    with av.open(io.BytesIO(data)) as container:
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    indices = sample(type("Meta", (), {"total_num_frames": len(every), "fps": fps})(), config)
    return every[indices], [int(i) for i in indices], fps, len(every)


def sample(metadata: Any, config: dict[str, Any]) -> np.ndarray:
    """`Qwen2VLVideoProcessor.sample_frames` (or Qwen3VLVideoProcessor's) at the saved fps."""
    total, patch = metadata.total_num_frames, config["temporal_patch_size"]
    if config["qwen3"]:
        num = int(total / metadata.fps * config["fps"])
        num = min(max(num, config["min_frames"]), config["max_frames"], total)
        return np.linspace(0, total - 1, num).round().astype(int)
    max_frames = math.floor(min(config["max_frames"], total) / patch) * patch
    num = total / metadata.fps * config["fps"]
    num = min(max(num, config["min_frames"]), max_frames, total)
    num = math.floor(num / patch) * patch
    return torch.arange(0, total, total / num).int().numpy()


def video_inputs(data: bytes, config: dict[str, Any]) -> VideoInputs:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    frames, indices, fps, total = decoded(data, config)
    video = torch.from_numpy(frames).contiguous().permute(0, 3, 1, 2).contiguous()
    patch, merge, temporal = config["patch_size"], config["merge_size"], config["temporal_patch_size"]
    factor = patch * merge
    size = config["size"]
    max_pixels = size["longest_edge"]
    height, width = video.shape[-2:]
    if config["qwen3"]:
        rh, rw = _qwen3_resize(len(frames), height, width, config)
    else:
        if config["cap_pixels_per_frame"]:
            total_pixels = int(config["max_video_tokens"] * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * temporal // len(frames)), int(size["shortest_edge"] * 1.05))
        rh, rw = smart_resize(height, width, factor=factor, min_pixels=size["shortest_edge"], max_pixels=max_pixels)
    if (rh, rw) != (height, width):
        video = torch.nn.functional.interpolate(
            video, size=[rh, rw], mode="bicubic", align_corners=False, antialias=True
        )
    mean = torch.tensor(config["image_mean"]) * (1.0 / config["rescale_factor"])
    std = torch.tensor(config["image_std"]) * (1.0 / config["rescale_factor"])
    video = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    if pad := -video.shape[0] % temporal:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
    t, gh, gw = video.shape[0] // temporal, rh // patch, rw // patch
    patches = video.view(1, t, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    rows = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(t * gh * gw, 3 * temporal * patch * patch)
    sampled_fps = len(indices) / total * fps
    text = _qwen3_text(indices, fps, temporal, gh * gw // merge**2) if config["qwen3"] else ""
    return VideoInputs(rows, (t, gh, gw), torch.tensor([temporal / sampled_fps])[0], indices, text)


def _qwen3_resize(num_frames: int, height: int, width: int, config: dict[str, Any]) -> tuple[int, int]:
    """Qwen3VLVideoProcessor.resize's size: transformers' own clip `smart_resize`, its per-frame cap applied."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    factor, size = config["patch_size"] * config["merge_size"], config["size"]
    max_pixels = size["longest_edge"]
    if config["cap_pixels_per_frame"]:
        frame_cap = config["max_video_tokens"] * factor * factor
        per_frame = max(min(frame_cap, size["longest_edge"] // num_frames), int(size["shortest_edge"] * 1.05))
        max_pixels = per_frame * num_frames
    return smart_resize(
        num_frames=num_frames,
        height=height,
        width=width,
        factor=factor,
        temporal_factor=config["temporal_patch_size"],
        min_pixels=size["shortest_edge"],
        max_pixels=max_pixels,
    )


def _qwen3_text(indices: list[int], fps: float, temporal: int, per_frame: int) -> str:
    """`Qwen3VLProcessor.replace_video_token`'s text, its timestamps from `_calculate_timestamps` itself."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, temporal)
    frame = "<|vision_start|>" + "<|video-expanded|>" * per_frame + "<|vision_end|>"
    return "".join(f"<{seconds:.1f} seconds>" + frame for seconds in stamps)


def hf_generate_media(
    model_dir: Path, messages: list[ChatMessage], media: list[Image.Image | bytes], max_tokens: int
) -> list[int]:
    """Greedy completion ids from `model.generate` for a conversation whose media parts are, in order,
    `media` (PIL images for image parts, encoded video bytes for video parts)."""
    loaded = _load(str(Path(model_dir).resolve()))
    config = loaded.model.config
    conversation = [
        {
            "role": m.role,
            "content": [{"type": p.kind} if p.kind != "text" else {"type": "text", "text": p.text} for p in m.parts],
        }
        for m in messages
    ]
    text = loaded.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    images = [m for m in media if isinstance(m, Image.Image)]
    videos = [video_inputs(m, video_config(model_dir)) for m in media if isinstance(m, bytes)]
    extra: dict[str, Any] = {}
    pads = {
        "image": loaded.tokenizer.convert_ids_to_tokens(config.image_token_id),
        "video": loaded.tokenizer.convert_ids_to_tokens(config.video_token_id),
    }
    merge = loaded.image_processor.merge_size
    counts = {"image": [], "video": [int(np.prod(v.video_grid_thw)) // merge**2 for v in videos]}
    if images:
        pixels = loaded.image_processor(images=images, return_tensors="pt")
        counts["image"] = [int(g.prod()) // merge**2 for g in pixels["image_grid_thw"]]
        extra.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    if videos:
        extra.update(
            pixel_values_videos=torch.cat([v.pixel_values_videos for v in videos]),
            video_grid_thw=torch.tensor([v.video_grid_thw for v in videos]),
        )
        if config.model_type == "qwen2_5_vl":
            extra["second_per_grid_ts"] = torch.stack([v.second_per_grid_t for v in videos])
    for kind, pad in pads.items():
        for index, count in enumerate(counts[kind]):
            expansion = videos[index].text if kind == "video" and videos[index].text else f"<|{kind}-expanded|>" * count
            text = text.replace(pad, expansion, 1)
        text = text.replace(f"<|{kind}-expanded|>", pad)
    encoded = loaded.tokenizer(text, return_tensors="pt")
    ids = encoded["input_ids"]
    types = (ids == config.image_token_id).to(torch.int32) + 2 * (ids == config.video_token_id).to(torch.int32)
    with torch.no_grad():
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=encoded["attention_mask"],
            mm_token_type_ids=types,
            max_new_tokens=max_tokens,
            do_sample=False,
            **extra,
        )
    return out[0, ids.shape[1] :].tolist()
