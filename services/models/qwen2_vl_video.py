"""Qwen2-VL / Qwen2.5-VL video rules without a processor: settings, frame sampling, token count, pixels.

transformers' `Qwen2VLVideoProcessor` needs torchvision, which does not run beside the CPU torch this
project pins, so its rules are written out here and proven equal to it on stored reference outputs
(tests/unit/test_qwen2_vl_video.py, made by scripts/video_reference.py where it runs). Followed exactly
(transformers 5.24): `sample_frames` (fps sampling: `num = total / video_fps * fps`, clamped to
[min_frames, min(max_frames, total)], floored to the temporal patch; indices `arange(0, total, total /
num).int()`), `smart_resize` per frame with the optional per-frame share of `max_video_tokens`
(`cap_pixels_per_frame`), torchvision's antialiased uint8 resize, the fused rescale-normalise, and
`patchify` (the last frame repeated up to a whole temporal patch). Qwen2.5-VL's `second_per_grid_ts` is
`temporal_patch_size / sampled_fps`, as float32 like the processor's tensor.

One artefact is followed as transformers' own PyAV reader meets it: for about 1% of (frames, fps) pairs the
float `arange` yields one index too many, equal to the frame count; the reader never reaches that frame, so
the model sees the others, while `sampled_fps` (from the metadata's indices) still counts it.

Deliberate differences: frames are always sampled (a folder whose processor says `do_sample_frames:
false` would otherwise take every decoded frame), at the saved `fps`, else 2.0 as qwen-vl-utils does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from services.models.base import ImageSizeError, PixelInputs, VideoError, VideoFramePlan, VideoTokens
from services.models.qwen2_vl_resize import smart_resize

DEFAULT_FPS = 2.0
"""Frames sampled per second when the folder saves none (qwen-vl-utils' FPS)."""
_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL resampling codes transformers maps to torch interpolation
# Qwen2VLVideoProcessor's class defaults (the qwen-vl-utils numbers: 128 and 768 tokens' worth of pixels).
_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "min_frames": 4,
    "max_frames": 768,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "cap_pixels_per_frame": False,
    "max_video_tokens": 128000,
    "resample": 3,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


@dataclass(frozen=True)
class VideoSettings:
    """Every saved video processor setting that changes which frames are sampled or their pixels."""

    min_pixels: int
    max_pixels: int
    fps: float
    min_frames: int
    max_frames: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_dict(cls, saved: dict[str, Any], defaults: dict[str, Any] | None = None) -> VideoSettings:
        """Settings as `Qwen2VLVideoProcessor(**saved)` holds them (its defaults, or a family's own `defaults`;
        `min_pixels`/`max_pixels` override `size`). Raises ValueError for what this rule does not implement."""
        values = {**(_DEFAULTS if defaults is None else defaults), **{k: v for k, v in saved.items() if v is not None}}
        size = dict(values["size"])
        low = saved.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        high = saved.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        if int(values["resample"]) not in _RESAMPLE or not values["do_resize"]:
            raise ValueError(f"video resize {values['resample']} (do_resize={values['do_resize']}) is not supported")
        return cls(
            min_pixels=int(low),
            max_pixels=int(high),
            fps=float(saved.get("fps") or DEFAULT_FPS),
            min_frames=int(values["min_frames"]),
            max_frames=int(values["max_frames"]),
            patch_size=int(values["patch_size"]),
            temporal_patch_size=int(values["temporal_patch_size"]),
            merge_size=int(values["merge_size"]),
            cap_pixels_per_frame=bool(values["cap_pixels_per_frame"]),
            max_video_tokens=int(values["max_video_tokens"]),
            resample=int(values["resample"]),
            do_rescale=bool(values["do_rescale"]),
            rescale_factor=float(values["rescale_factor"]),
            do_normalize=bool(values["do_normalize"]),
            image_mean=tuple(float(v) for v in values["image_mean"]),
            image_std=tuple(float(v) for v in values["image_std"]),
        )

    def as_json(self) -> dict[str, Any]:
        """The settings as a JSON-able dict (part of `mm_hash`)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def sample_frame_indices(total_frames: int, video_fps: float, settings: VideoSettings) -> tuple[int, ...]:
    """The indices `Qwen2VLVideoProcessor.sample_frames` returns at `settings.fps` for a video of
    `total_frames` frames at `video_fps` (one may equal `total_frames`: see the module docstring).
    Raises VideoError when not even one temporal patch fits."""
    patch = settings.temporal_patch_size
    if total_frames < patch or not video_fps > 0:
        raise VideoError(f"a video needs at least {patch} frames and a frame rate, got {total_frames} at {video_fps}")
    max_frames = math.floor(min(settings.max_frames, total_frames) / patch) * patch
    wanted = total_frames / video_fps * settings.fps
    wanted = min(max(wanted, settings.min_frames), max_frames, total_frames)
    count = math.floor(wanted / patch) * patch
    if count < patch:
        raise VideoError(f"cannot sample {patch} frames from {total_frames} with max_frames {settings.max_frames}")
    return tuple(torch.arange(0, total_frames, total_frames / count).int().tolist())


def frame_max_pixels(settings: VideoSettings, num_frames: int) -> int | float:
    """The per-frame pixel cap: `max_pixels`, or with `cap_pixels_per_frame` its even share of the
    whole video's budget (`max_video_tokens` x 0.9 tokens' worth), never below 1.05 x `min_pixels`."""
    if not settings.cap_pixels_per_frame:
        return settings.max_pixels
    factor = settings.patch_size * settings.merge_size
    total_pixels = int(settings.max_video_tokens * factor * factor * 0.9)
    share = total_pixels * settings.temporal_patch_size // num_frames
    return max(min(settings.max_pixels, share), int(settings.min_pixels * 1.05))


def video_tokens(
    width: int, height: int, total_frames: int, video_fps: float, settings: VideoSettings, time_scaled: bool
) -> VideoTokens:
    """What a `width` x `height` video of `total_frames` frames at `video_fps` becomes, from its header.

    `time_scaled`: the family's positions use `second_per_grid_t` (Qwen2.5-VL). Raises VideoError.
    """
    sampled = sample_frame_indices(total_frames, video_fps, settings)
    indices = tuple(index for index in sampled if index < total_frames)
    factor = settings.patch_size * settings.merge_size
    try:
        resized_h, resized_w = smart_resize(
            height, width, factor, settings.min_pixels, frame_max_pixels(settings, len(indices))
        )
    except ImageSizeError as exc:
        raise VideoError(str(exc).replace("image", "video frame")) from None
    patch = settings.temporal_patch_size
    grid = (-(-len(indices) // patch), resized_h // settings.patch_size, resized_w // settings.patch_size)
    sampled_fps = len(sampled) / total_frames * video_fps
    seconds = float(np.float32(patch / sampled_fps)) if time_scaled else 0.0
    return VideoTokens(
        num_tokens=grid[0] * grid[1] * grid[2] // settings.merge_size**2,
        grid_thw=grid,
        resized_height=resized_h,
        resized_width=resized_w,
        frame_indices=indices,
        second_per_grid_t=seconds,
    )


def frame_plan(
    grid_thw: tuple[int, int, int], frame_indices: tuple[int, ...], settings: VideoSettings
) -> VideoFramePlan:
    """The frames to decode for a video counted as `grid_thw` with `frame_indices`, and their resized size.

    Raises VideoError when the grid and the frame count disagree (a router and encoder out of step).
    """
    t, h, w = grid_thw
    if not frame_indices or t != -(-len(frame_indices) // settings.temporal_patch_size):
        raise VideoError(f"grid {tuple(grid_thw)} does not hold {len(frame_indices)} frames")
    if list(frame_indices) != sorted(set(frame_indices)) or frame_indices[0] < 0:
        raise VideoError("frame indices must be increasing and non-negative")
    patch = settings.patch_size
    return VideoFramePlan(tuple(frame_indices), h * patch, w * patch, _RESAMPLE[settings.resample])


def video_pixels(frames: np.ndarray, grid_thw: tuple[int, int, int], settings: VideoSettings) -> PixelInputs:
    """Normalise and patchify resized frames (`[T, H, W, 3]` uint8) as the video processor does; returns
    `[grid_t * grid_h * grid_w, 3 * temporal_patch * patch**2]` float32 rows in the tower's order."""
    t, grid_h, grid_w = grid_thw
    patch, merge, temporal = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    if frames.ndim != 4 or frames.shape[1:] != (grid_h * patch, grid_w * patch, 3) or frames.dtype != np.uint8:
        raise ValueError(f"frames {frames.shape} {frames.dtype} do not match grid {tuple(grid_thw)}")
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    video = _rescale_normalize(video, settings)
    if pad := -video.shape[0] % temporal:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
    if video.shape[0] != t * temporal:
        raise ValueError(f"{frames.shape[0]} frames do not fill grid {tuple(grid_thw)}")
    channels = video.shape[1]
    patches = video.view(t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = patches.reshape(t * grid_h * grid_w, channels * temporal * patch * patch)
    return PixelInputs(pixel_values=rows, grid_thw=(t, grid_h, grid_w))


def _rescale_normalize(video: torch.Tensor, settings: VideoSettings) -> torch.Tensor:
    """transformers' torchvision `rescale_and_normalize`: mean and std scaled by 1/rescale_factor (fused),
    then `(x - mean) / std` in float32."""
    mean, std = list(settings.image_mean), list(settings.image_std)
    if settings.do_rescale and settings.do_normalize:
        mean_t = torch.tensor(mean) * (1.0 / settings.rescale_factor)
        std_t = torch.tensor(std) * (1.0 / settings.rescale_factor)
    elif settings.do_normalize:
        mean_t, std_t = torch.tensor(mean), torch.tensor(std)
    elif settings.do_rescale:
        return video * settings.rescale_factor
    else:
        return video.to(torch.float32)
    return video.to(torch.float32).sub_(mean_t.view(-1, 1, 1)).div_(std_t.view(-1, 1, 1))


class Qwen2VLVideoMixin:
    """The `VideoAdapter` half of `Qwen2VLAdapter`, over its `image_token_id`, `video_token_id`,
    `video_settings` (None without a folder) and `tokens_per_second` (Qwen2.5-VL's; None for Qwen2-VL)."""

    image_token_id: int
    video_token_id: int
    video_settings: VideoSettings | None
    tokens_per_second: float | None

    def placeholder_token_id(self, modality: str) -> int:
        """`<|image_pad|>` for images, `<|video_pad|>` for videos."""
        if modality == "image":
            return self.image_token_id
        if modality == "video":
            return self.video_token_id
        raise ValueError(f"no placeholder for modality {modality!r}")

    def video_tokens(self, width: int, height: int, total_frames: int, fps: float) -> VideoTokens:
        """Frames, grid and tokens of a video from its header (see `video_tokens` above)."""
        return video_tokens(width, height, total_frames, fps, self._video(), self.tokens_per_second is not None)

    def video_frame_plan(self, grid_thw: tuple[int, int, int], frame_indices: tuple[int, ...]) -> VideoFramePlan:
        """Which frames the encoder decodes and the size it resizes them to."""
        return frame_plan(grid_thw, frame_indices, self._video())

    def preprocess_video(self, frames: np.ndarray, grid_thw: tuple[int, int, int]) -> PixelInputs:
        """Pixel inputs of resized frames (`[T, H, W, 3]` uint8), as the video processor makes them."""
        return video_pixels(frames, grid_thw, self._video())

    def _video(self) -> VideoSettings:
        if self.video_settings is None:
            raise VideoError("this model takes no video: no model folder, or unsupported video processor settings")
        return self.video_settings
