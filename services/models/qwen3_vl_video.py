"""Qwen3-VL video rules without a processor: frame sampling, the clip's resize, timestamps and the prompt text.

transformers' `Qwen3VLVideoProcessor` needs torchvision, which does not run beside the CPU torch this project pins,
so its rules are written out here and proven equal to it on stored reference outputs (tests/unit/test_qwen3_vl_video.py,
made by scripts/video_reference.py where it runs). Followed exactly (transformers 5.24), where it differs from
Qwen2-VL's (services/models/qwen2_vl_video.py):

- `sample_frames`: `num = int(frames / video_fps x fps)` clamped to [min_frames, min(max_frames, frames)], not
  rounded to the temporal patch; indices `linspace(0, frames - 1, num).round()` (the last frame repeats to fill a
  temporal patch when `num` is odd, as `patchify` pads).
- The resize bounds the whole clip: `smart_resize(num_frames, h, w)` compares `t_bar x h x w` with the saved
  `size` (shortest_edge..longest_edge pixels over all frames; `t_bar` the frame count rounded to the temporal
  patch), and with `cap_pixels_per_frame` the bound is `max(min(max_video_tokens x 32^2, longest // frames),
  1.05 x shortest) x frames`.
- Timestamps: each temporal patch's seconds are the mean of its first and last frame's `index / video_fps` (the
  indices padded with the last to a whole patch, `Qwen3VLProcessor._calculate_timestamps`), and the prompt holds,
  per patch, `<{t:.1f} seconds><|vision_start|>` + its frame's tokens + `<|vision_end|>` where the chat template
  put the video's `<|video_pad|>` (inside the template's own vision_start/vision_end).

Pixels (normalise, patchify) and the frame plan are Qwen2-VL's (`video_pixels`, `frame_plan`: the same torchvision
resize and the same patch order), over these settings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from services.models.base import VideoError, VideoTokens
from services.models.qwen2_vl_video import VideoSettings

DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
    "min_frames": 4,
    "max_frames": 768,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "cap_pixels_per_frame": False,
    "max_video_tokens": 768,
    "resample": 3,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
"""Qwen3VLVideoProcessor's class defaults (its `size` bounds the whole clip's pixels; `fps` 2)."""


def video_settings(saved: dict[str, Any]) -> VideoSettings:
    """Settings as `Qwen3VLVideoProcessor(**saved)` holds them. `min_pixels` / `max_pixels` bound the whole clip
    (`t_bar x h x w`), not one frame. Raises ValueError for what this rule does not implement."""
    return VideoSettings.from_dict(saved, DEFAULTS)


def sample_frame_indices(total_frames: int, video_fps: float, settings: VideoSettings) -> tuple[int, ...]:
    """The indices `Qwen3VLVideoProcessor.sample_frames` returns at `settings.fps`. Raises VideoError when not even
    one temporal patch's worth of frames can be taken."""
    patch = settings.temporal_patch_size
    if total_frames < patch or not video_fps > 0:
        raise VideoError(f"a video needs at least {patch} frames and a frame rate, got {total_frames} at {video_fps}")
    count = int(total_frames / video_fps * settings.fps)
    count = min(max(count, settings.min_frames), settings.max_frames, total_frames)
    if count < patch:
        raise VideoError(f"cannot sample {patch} frames from {total_frames} with max_frames {settings.max_frames}")
    return tuple(int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(int))


def clip_max_pixels(settings: VideoSettings, num_frames: int) -> int:
    """The clip's pixel bound for `num_frames` sampled frames: `max_pixels`, or with `cap_pixels_per_frame` each
    frame's share (at most `max_video_tokens` tokens' worth, at least 1.05 x `min_pixels`) times the frames."""
    if not settings.cap_pixels_per_frame:
        return settings.max_pixels
    factor = settings.patch_size * settings.merge_size
    frame_cap = settings.max_video_tokens * factor * factor
    per_frame = max(min(frame_cap, settings.max_pixels // num_frames), int(settings.min_pixels * 1.05))
    return per_frame * num_frames


def clip_resize(num_frames: int, height: int, width: int, settings: VideoSettings, max_pixels: int) -> tuple[int, int]:
    """`(height, width)` of every frame after the video processor's `smart_resize` over the whole clip."""
    temporal, factor = settings.temporal_patch_size, settings.patch_size * settings.merge_size
    if num_frames < temporal:
        raise VideoError(f"a video needs at least {temporal} sampled frames, got {num_frames}")
    if height <= 0 or width <= 0:
        raise VideoError(f"video frames of {width}x{height} pixels")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoError(
            f"video frame aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(indices: tuple[int, ...], video_fps: float, temporal_patch: int) -> tuple[float, ...]:
    """Seconds of each temporal patch: the mean of its first and last frame's `index / video_fps`, the indices
    padded with the last one to a whole patch (as `Qwen3VLProcessor._calculate_timestamps`)."""
    padded = list(indices)
    if len(padded) % temporal_patch:
        padded.extend(padded[-1] for _ in range(temporal_patch - len(padded) % temporal_patch))
    seconds = [index / video_fps for index in padded]
    return tuple((seconds[i] + seconds[i + temporal_patch - 1]) / 2 for i in range(0, len(seconds), temporal_patch))


def video_tokens(width: int, height: int, total_frames: int, video_fps: float, settings: VideoSettings) -> VideoTokens:
    """What a `width` x `height` video of `total_frames` frames at `video_fps` becomes, from its header: the
    sampled frames, the grid, the placeholder tokens (`num_tokens`: timestamps and the frame groups' own
    vision_start/vision_end are text, counted by the prompt) and each temporal patch's timestamp. Raises VideoError."""
    indices = sample_frame_indices(total_frames, video_fps, settings)
    resized_h, resized_w = clip_resize(len(indices), height, width, settings, clip_max_pixels(settings, len(indices)))
    patch = settings.temporal_patch_size
    grid = (-(-len(indices) // patch), resized_h // settings.patch_size, resized_w // settings.patch_size)
    return VideoTokens(
        num_tokens=grid[0] * grid[1] * grid[2] // settings.merge_size**2,
        grid_thw=grid,
        resized_height=resized_h,
        resized_width=resized_w,
        frame_indices=indices,
        timestamps=frame_timestamps(indices, video_fps, patch),
    )


def video_text(timestamps: tuple[float, ...], vision_start: str, placeholder: str, vision_end: str) -> str:
    """What a video's one placeholder becomes in the rendered chat text, with ONE placeholder per frame group (the
    adapter widens each to the group's tokens): `<{t:.1f} seconds>` + vision_start + placeholder + vision_end per
    temporal patch, as `Qwen3VLProcessor.replace_video_token` writes it."""
    return "".join(f"<{seconds:.1f} seconds>{vision_start}{placeholder}{vision_end}" for seconds in timestamps)
