"""Reference outputs of transformers' own Qwen2-VL / Qwen2.5-VL / Qwen3-VL video processing, for the video rule tests.

transformers' video processors need torchvision, which cannot run beside this project's CPU torch; this
script runs where it can and stores what the real processors produce, and tests/unit/test_qwen2_vl_video.py and
tests/unit/test_qwen3_vl_video.py prove our rules (services/models/qwen2_vl_video.py, qwen3_vl_video.py) and the
test oracle (tests/oracle_video.py) equal to it.

    python scripts/video_reference.py [OUT_DIR]      (default tests/data/video_reference)

Needs torchvision matching torch. Its PyPI wheel built for CUDA loads against a CPU-only torch except for
its compiled detection operators (nms, roi_align, ...), whose fake-kernel registration then fails at import:
that registration alone is skipped here (the video path calls none of them; resize and normalise are
torch ops). Writes, per video: the file, and per family the processor's sampled frame indices,
`video_grid_thw`, `second_per_grid_ts` (Qwen2.5-VL), the prompt's `input_ids` (Qwen3-VL's with its timestamps),
and the sha256, shape and
sum of `pixel_values_videos`; and, for header-only cases (no file), the indices and grid.

Decoding for the reference: where the header counts frames (MP4), transformers' own `read_video_pyav`
with the video processor's `sample_frames`, then the processor on those frames and that metadata (the
pipeline `processor(videos=path)` runs with the PyAV backend); a WebM header counts none, which that reader
cannot sample from, so there every frame goes through the same `to_ndarray(format="rgb24")`, the metadata
is the decoded count and `float(average_rate)`, and the processor samples the frames.

A video file already in OUT_DIR is read, not made again (the codecs' bytes differ between runs), so a rerun
over the stored folder adds a family without changing what the other families' entries describe.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
PROMPT = "What happens in the video?"
# name -> media_factory.video arguments: odd sizes, 1-20 s, 10-60 fps, mp4 (H.264 4:2:0 / 4:4:4, MPEG-4) and webm.
VIDEOS: dict[str, dict] = {
    "mp4_97x61_15fps_2s": {"w": 97, "h": 61, "seconds": 2.0, "fps": 15},
    "mp4_160x90_60fps_3s": {"w": 160, "h": 90, "seconds": 3.0, "fps": 60},
    "mp4_mpeg4_75x133_10fps_1s": {"w": 75, "h": 133, "seconds": 1.0, "fps": 10, "codec": "mpeg4"},
    "webm_121x67_24fps_2s": {"w": 121, "h": 67, "seconds": 2.0, "fps": 24, "container": "webm"},
    "webm_vp8_64x48_30fps_4s": {"w": 64, "h": 48, "seconds": 4.0, "fps": 30, "container": "mkv"},
    "mp4_58x40_25fps_20s": {"w": 58, "h": 40, "seconds": 20.0, "fps": 25},
    "mp4_100x70_ntsc_5s": {"w": 100, "h": 70, "seconds": 5.0, "fps": Fraction(30000, 1001)},
    "webm_90x150_50fps_1s": {"w": 90, "h": 150, "seconds": 1.0, "fps": 50, "container": "webm"},
    # 75 frames at 10 fps: the sampling's float arange yields a 15th index, 75, past the last frame
    "mp4_80x64_10fps_7.5s": {"w": 80, "h": 64, "seconds": 7.5, "fps": 10},
}
# header-only cases: (width, height, total_frames, fps); the last ones engage the per-frame pixel cap.
HEADERS = [
    (97, 61, 30, 15.0),
    (1920, 1080, 120, 60.0),
    (640, 480, 5, 30.0),
    (333, 500, 301, 29.97),
    (50, 700, 47, 23.976),
    (1280, 720, 600, 59.94),
    (720, 1280, 10, 10.0),
    (7, 5, 8, 4.0),
    (100, 70, 150, 30000 / 1001),
    (640, 480, 3600, 60.0),
    (1024, 768, 1500, 25.0),
    (300, 200, 9000, 30.0),
    (200, 150, 1700, 1.0),
]


def import_torchvision() -> None:
    """Import torchvision even where its compiled detection operators do not load (see module docstring)."""
    import torch.library

    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        register = torch.library.register_fake
        torch.library.register_fake = lambda *args, **kwargs: lambda fn: fn
        try:
            import torchvision  # noqa: F401
        finally:
            torch.library.register_fake = register


def decode_all(data: bytes) -> tuple[np.ndarray, dict]:
    """Every frame as rgb24, and the metadata transformers' PyAV reader takes from the header."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
        total = int(stream.frames) or len(frames)
        return frames, {
            "total_num_frames": total,
            "fps": float(stream.average_rate),
            "width": stream.width,
            "height": stream.height,
        }


def processed(processor, frames: np.ndarray, meta: dict, data: bytes | None = None) -> dict:
    """The processor's outputs for one video: sampled by the processor from all `frames`, or, given the
    file's `data`, read and sampled by transformers' `read_video_pyav` (then `frames`/`meta` are unused)."""
    from transformers.video_utils import VideoMetadata, read_video_pyav

    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    text = processor.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if data is not None:
        frames, metadata = read_video_pyav(io.BytesIO(data), processor.video_processor.sample_frames)
        kwargs = {"video_metadata": [metadata], "do_sample_frames": False}
        indices = metadata.frames_indices
    else:
        kwargs = {"video_metadata": [VideoMetadata(**meta)]}
        sampled = processor.video_processor(videos=[frames], return_metadata=True, return_tensors="pt", **kwargs)
        indices = sampled["video_metadata"][0].frames_indices
        kwargs = {"video_metadata": [VideoMetadata(**meta)]}
    out = processor(text=[text], videos=[frames], return_tensors="pt", **kwargs)
    pixels = out["pixel_values_videos"].contiguous()
    record = {
        "frame_indices": [int(i) for i in indices],
        "video_grid_thw": [int(v) for v in out["video_grid_thw"][0]],
        "input_ids": [int(v) for v in out["input_ids"][0]],
        "pixel_shape": list(pixels.shape),
        "pixel_sha256": hashlib.sha256(pixels.numpy().tobytes()).hexdigest(),
        "pixel_sum": float(pixels.double().sum()),
    }
    if "second_per_grid_ts" in out:
        record["second_per_grid_ts"] = [float(v) for v in out["second_per_grid_ts"]]
    return record


def header_case(processor, width: int, height: int, total: int, fps: float) -> dict:
    frames = np.broadcast_to(np.zeros((1, height, width, 3), np.uint8), (total, height, width, 3))  # no copy
    meta = {"total_num_frames": total, "fps": fps, "width": width, "height": height}
    record = processed(processor, frames, meta)
    return {k: record[k] for k in ("frame_indices", "video_grid_thw", "second_per_grid_ts") if k in record}


def main(out_dir: Path) -> None:
    import_torchvision()
    from transformers import AutoProcessor

    from services.models.tiny_model import make_tiny_model
    from tests import media_factory

    out_dir.mkdir(parents=True, exist_ok=True)
    reference: dict = {"videos": {}, "headers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        processors = {f: AutoProcessor.from_pretrained(make_tiny_model(Path(tmp) / f, f)) for f in FAMILIES}
        for name, args in VIDEOS.items():
            suffix = {"mp4": "mp4", "webm": "webm", "mkv": "mkv"}[args.get("container", "mp4")]
            stored = out_dir / f"{name}.{suffix}"
            data = stored.read_bytes() if stored.exists() else media_factory.video(**args)  # encoders vary by run
            stored.write_bytes(data)
            frames, meta = decode_all(data)
            reader = data if suffix == "mp4" else None
            entry = {"file": f"{name}.{suffix}", "metadata": meta}
            entry.update({family: processed(p, frames, meta, reader) for family, p in processors.items()})
            reference["videos"][name] = entry
            print(name, meta, entry["qwen2.5-vl"]["video_grid_thw"], flush=True)
        for width, height, total, fps in HEADERS:
            key = f"{width}x{height}_{total}f_{fps}fps"
            reference["headers"][key] = {
                "header": [width, height, total, fps],
                **{family: header_case(p, width, height, total, fps) for family, p in processors.items()},
            }
            print(key, reference["headers"][key]["qwen2.5-vl"]["video_grid_thw"], flush=True)
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "video_reference")
