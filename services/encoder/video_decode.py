"""Encoder-side video decode: the planned frames out of untrusted bytes, resized, within limits and a time bound.

Runs in a preprocessing-pool child (`video_job`). Opens through `services.common.video.open_video` (the
router's header path and limits), decodes in presentation order up to the last planned frame, converts each
planned frame to RGB with PyAV's `to_ndarray(format="rgb24")` (as transformers' PyAV reader does) and resizes
it at once with torch's antialiased uint8 `interpolate` (as transformers' torchvision video processors do),
so a child holds one full-size frame at a time and hands back only the resized frames. torch is imported in
a child on its first video and runs one thread there (the pool is the parallelism).

Decisions (every refusal is a `MediaError`, INVALID_ARGUMENT for the client):
- The frames decoded are exactly the plan's (`VideoFramePlan`, from the router's count): a stream that ends
  before the last planned frame (its header promised more) is refused (`corrupt`), never padded, so what the
  encoder produces is what was admitted, or nothing.
- A frame whose size differs from the header's is refused (the plan's size came from it); decoders run with
  FFmpeg's `max_pixels` at the limit, so a frame above it is refused inside the decoder, unallocated.
- Past `timeout_s` (checked before each frame) the video is refused with reason `timeout`.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.media_types import MediaError, MediaReason, VideoHeader, VideoLimits
from services.common.video import open_video
from services.models.base import VideoFramePlan

_torch: Any = None


@dataclass(frozen=True)
class VideoResult:
    """The planned frames, resized: `frames` is `[T, height, width, 3]` uint8; timings as `PreprocessResult`'s."""

    frames: np.ndarray
    header: VideoHeader
    queue_s: float
    decode_s: float


def video_job(
    data: bytes, plan: VideoFramePlan, limits: VideoLimits, timeout_s: float, submitted_at: float, index: int | None
) -> VideoResult:
    """Runs in a child: decode and resize the planned frames of `data`. Raises `MediaError`."""
    started = time.monotonic()
    frames, header = decode_video(data, plan, limits, timeout_s, index=index)
    return VideoResult(frames, header, max(0.0, started - submitted_at), time.monotonic() - started)


def decode_video(
    data: bytes, plan: VideoFramePlan, limits: VideoLimits, timeout_s: float, *, index: int | None = None
) -> tuple[np.ndarray, VideoHeader]:
    """The plan's frames of `data`, resized to the plan's size, and the header they were checked against."""
    deadline = time.monotonic() + timeout_s
    try:
        with open_video(data, limits) as (container, header):
            frames = _decode_planned(container, header, plan, limits, deadline, timeout_s)
    except MediaError as exc:
        raise exc if index is None else exc.with_index(index) from None
    return frames, header


def _decode_planned(
    container: Any, header: VideoHeader, plan: VideoFramePlan, limits: VideoLimits, deadline: float, timeout_s: float
) -> np.ndarray:
    import av

    stream = container.streams.video[0]
    stream.codec_context.thread_count = 1
    stream.codec_context.options = {"max_pixels": str(limits.max_frame_pixels)}
    wanted = {frame: slot for slot, frame in enumerate(plan.frame_indices)}
    out = np.empty((len(plan.frame_indices), plan.height, plan.width, 3), np.uint8)
    filled, last = 0, plan.frame_indices[-1]
    try:
        container.seek(0)
        for number, frame in enumerate(container.decode(stream)):
            if time.monotonic() > deadline:
                raise _refuse(f"decoding took longer than {timeout_s:g}s (at frame {number})", MediaReason.TIMEOUT)
            if number in wanted:
                if (frame.width, frame.height) != (header.width, header.height):
                    raise _refuse(
                        f"frame {number} is {frame.width}x{frame.height}, the header says {header.width}x"
                        f"{header.height}",
                        MediaReason.CORRUPT,
                    )
                out[wanted[number]] = resize_frame(frame.to_ndarray(format="rgb24"), plan)
                filled += 1
            if number >= last:
                break
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise _refuse(f"corrupt video stream after {filled} sampled frames ({exc})", MediaReason.CORRUPT) from None
    if filled < len(plan.frame_indices):
        raise _refuse(
            f"the stream ended before frame {last}: the header promised {header.frames} frames", MediaReason.CORRUPT
        )
    return out


def resize_frame(frame: np.ndarray, plan: VideoFramePlan) -> np.ndarray:
    """One `[H, W, 3]` uint8 frame resized to the plan's size as torchvision's `resize` does a uint8 CPU tensor
    (antialiased; bicubic in uint8 directly, bilinear in uint8 where torch has that kernel, else via float32
    with rounding); unchanged when it already has that size."""
    if frame.shape[:2] == (plan.height, plan.width):
        return frame
    torch = _import_torch()
    image = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).contiguous().unsqueeze(0)
    native = plan.resample == "bicubic" or _native_uint8_bilinear(torch)
    source = image if native else image.to(torch.float32)
    resized = torch.nn.functional.interpolate(
        source, size=[plan.height, plan.width], mode=plan.resample, align_corners=False, antialias=True
    )
    if not native:
        resized = resized.round_().to(torch.uint8)
    return resized[0].permute(1, 2, 0).numpy()


def _native_uint8_bilinear(torch: Any) -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


def _import_torch() -> Any:
    global _torch
    if _torch is None:
        import multiprocessing

        import torch

        if multiprocessing.parent_process() is not None:  # a pool child: the pool is the parallelism
            torch.set_num_threads(1)
        _torch = torch
    return _torch


def _refuse(detail: str, reason: MediaReason) -> MediaError:
    return MediaError(detail, reason, media="video")
