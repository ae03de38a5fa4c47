"""Video headers, refusals, the encoder's frame decode and the preprocessing cache, on videos made here."""

from __future__ import annotations

import pickle
import time
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from services.common.media_types import MediaError, MediaReason, VideoLimits
from services.common.video import probe_video
from services.common.video_bytes import MAX_BOXES, mp4_track_samples, sniff_container
from services.encoder import video_decode
from services.encoder.preprocess_cache import PreprocessCache, preprocess_key
from services.encoder.preprocess_pool import PreprocessPool
from services.encoder.video_decode import decode_video, resize_frame, video_job
from services.models.base import VideoFramePlan
from tests import media_factory

LIMITS = VideoLimits()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"w": 97, "h": 61, "seconds": 2, "fps": 15}, ("mp4", "h264", 97, 61, 30, 15.0, False)),
        ({"w": 64, "h": 48, "seconds": 1, "fps": 60, "codec": "mpeg4"}, ("mp4", "mpeg4", 64, 48, 60, 60.0, False)),
        (
            {"w": 121, "h": 67, "seconds": 3, "fps": 24, "container": "webm"},
            ("matroska", "vp9", 121, 67, 72, 24.0, True),
        ),
        ({"w": 50, "h": 30, "seconds": 2, "fps": 10, "container": "mkv"}, ("matroska", "vp8", 50, 30, 20, 10.0, True)),
        (
            {"w": 40, "h": 40, "seconds": 3, "fps": Fraction(30000, 1001)},
            ("mp4", "h264", 40, 40, 90, 30000 / 1001, False),
        ),
    ],
)
def test_header_reads_size_frames_and_rate_without_decoding(args: dict, expected: tuple) -> None:
    header = probe_video(media_factory.video(**args), LIMITS)
    got = (header.format, header.codec, header.width, header.height, header.frames, header.fps, header.frames_estimated)
    assert got == expected
    assert header.duration_s == pytest.approx(header.frames / header.fps)


def _hostile() -> dict[str, tuple[bytes, MediaReason, str]]:
    real = media_factory.video(96, 60, seconds=1, fps=10)
    return {
        "empty": (b"", MediaReason.EMPTY, "empty"),
        "audio_only_mp4": (media_factory.audio_only(), MediaReason.FORMAT, "no video stream"),
        "audio_only_webm": (media_factory.audio_only(container="webm"), MediaReason.FORMAT, "no video stream"),
        "an_image": (media_factory.jpeg(64, 64), MediaReason.FORMAT, "not a video container"),
        "random_bytes": (np.random.default_rng(0).bytes(4096), MediaReason.FORMAT, "not a video container"),
        "garbage_after_ftyp": (real[:32] + bytes(range(256)) * 20, MediaReason.CORRUPT, "corrupt"),
        "header_cut_short": (real[:200], MediaReason.CORRUPT, "corrupt"),
        "ebml_garbage": (b"\x1a\x45\xdf\xa3" + bytes(range(256)) * 20, MediaReason.CORRUPT, "corrupt"),
        "bad_box_size": (
            b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00\x00\x00\x00\x04moov",
            MediaReason.CORRUPT,
            "malformed",
        ),
        "claims_1e6_frames": (media_factory.mp4_declaring_frames(real, 10**6), MediaReason.FRAMES, "samples"),
        "claims_2e7_frames": (media_factory.mp4_declaring_frames(real, 2 * 10**7), MediaReason.FRAMES, "samples"),
        "frames_too_large": (media_factory.video(96, 60, seconds=0.3), MediaReason.PIXELS, "pixel"),
        "too_long": (media_factory.video(16, 16, seconds=12, fps=1, codec="mpeg4"), MediaReason.DURATION, "lasts"),
        "too_many_frames": (media_factory.video(16, 16, seconds=1, fps=60, codec="mpeg4"), MediaReason.FRAMES, "holds"),
    }


class _RecordingContainer:
    """A PyAV container that records each call that reads frames (`demux`, `decode`, `seek`)."""

    def __init__(self, container: Any, reads: list[str]) -> None:
        self._container = container
        self._reads = reads

    def __getattr__(self, name: str) -> Any:
        if name in ("demux", "decode", "seek"):
            self._reads.append(name)
        return getattr(self._container, name)


def _record_frame_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every container opened from here on records its frame reads into the returned list."""
    import av

    reads: list[str] = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **kw: _RecordingContainer(real_open(*a, **kw), reads))
    return reads


@pytest.mark.parametrize("name", list(_hostile()))
def test_hostile_videos_are_refused_from_the_header_without_reading_a_frame(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, reason, needle = _hostile()[name]
    limits = VideoLimits(max_frame_pixels=96 * 60 - 1) if name == "frames_too_large" else LIMITS
    limits = VideoLimits(max_seconds=10.0) if name == "too_long" else limits
    limits = VideoLimits(max_frames=50) if name == "too_many_frames" else limits
    fine = media_factory.video(32, 32)
    reads = _record_frame_reads(monkeypatch)
    with pytest.raises(MediaError) as info:
        probe_video(data, limits, index=3)
    assert info.value.reason == reason and needle in str(info.value).lower(), str(info.value)
    assert str(info.value).startswith("video 3: ")
    assert reads == [], f"{name}: frames read before the refusal"
    decode_video(fine, VideoFramePlan((0,), 32, 32), LIMITS, timeout_s=30)
    assert "decode" in reads  # the recording sees frame reads when there are some


def test_a_sample_table_bomb_never_reaches_the_demuxer() -> None:
    """20 million claimed samples: opening it with FFmpeg takes over a second and 1.4 GB; refused before."""
    import resource

    bomb = media_factory.mp4_declaring_frames(media_factory.video(96, 60, seconds=1, fps=10), 2 * 10**7)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MediaError, match="claims 20000000 samples"):
        probe_video(bomb, LIMITS)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: under 64 MiB more
    assert mp4_track_samples(bomb) == {1: 2 * 10**7}


def test_box_walk_is_bounded_and_sniffing_is_by_magic() -> None:
    many = b"".join(b"\x00\x00\x00\x08free" for _ in range(MAX_BOXES + 1))
    assert mp4_track_samples(b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00" + many) is None
    assert sniff_container(media_factory.video(32, 32)) == "mp4"
    assert sniff_container(media_factory.video(32, 32, container="webm")) == "matroska"
    assert sniff_container(media_factory.png(8, 8)) is None


def test_media_error_keeps_its_kind_across_processes() -> None:
    error = pickle.loads(pickle.dumps(MediaError("too long", MediaReason.DURATION, index=2, media="video")))
    assert (str(error), error.reason, error.media) == ("video 2: too long", MediaReason.DURATION, "video")
    assert str(MediaError("bad", MediaReason.CORRUPT).with_index(1)) == "image 1: bad"


# --- the encoder's decode ---------------------------------------------------------------------------------


def test_decode_takes_exactly_the_planned_frames() -> None:
    count = 20
    data = media_factory.video(48, 32, seconds=2, fps=10, codec="mpeg4")
    every = media_factory.video_frames(48, 32, count)
    plan = VideoFramePlan((0, 7, 19), 32, 48)  # at the stream's own size: no resize
    frames, header = decode_video(data, plan, LIMITS, timeout_s=10)
    assert frames.shape == (3, 32, 48, 3) and header.frames == count
    # lossy codec: each decoded frame is nearest to its own source frame
    for slot, index in enumerate(plan.frame_indices):
        errors = [np.abs(frames[slot].astype(int) - every[i].astype(int)).mean() for i in range(count)]
        assert int(np.argmin(errors)) == index


def test_decode_resizes_as_torchvision_does() -> None:
    """A frame's resize equals torch's antialiased uint8 bicubic `interpolate` of the whole [C, H, W] image."""
    import torch

    frame = media_factory.pattern(97, 61, seed=3)
    plan = VideoFramePlan((0,), 252, 420)
    expected = torch.nn.functional.interpolate(
        torch.from_numpy(frame).permute(2, 0, 1)[None].contiguous(),
        size=[252, 420],
        mode="bicubic",
        align_corners=False,
        antialias=True,
    )[0].permute(1, 2, 0)
    assert np.array_equal(resize_frame(frame, plan), expected.numpy())
    assert resize_frame(frame, VideoFramePlan((0,), 61, 97)) is frame


def test_a_stream_shorter_than_its_header_is_refused_not_padded() -> None:
    liar = media_factory.mp4_declaring_frames(media_factory.video(96, 60, seconds=1, fps=10), 40)
    header = probe_video(liar, LIMITS)
    assert header.frames == 40
    with pytest.raises(MediaError) as info:
        decode_video(liar, VideoFramePlan((0, 10, 20, 38), 60, 96), LIMITS, timeout_s=10, index=0)
    assert info.value.reason == MediaReason.CORRUPT and str(info.value).startswith("video 0: ")


def test_decode_past_its_time_bound_is_refused() -> None:
    data = media_factory.video(320, 240, seconds=10, fps=30, codec="mpeg4")
    plan = VideoFramePlan(tuple(range(0, 300, 5)), 960, 1280)  # 60 frames, each resized 16x: ~0.5 s in all
    with pytest.raises(MediaError) as info:
        decode_video(data, plan, LIMITS, timeout_s=0.05)
    assert info.value.reason == MediaReason.TIMEOUT and "longer than 0.05s" in str(info.value)


def test_decode_stops_at_the_first_frame_past_its_time_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that moves one second per resized frame, a 2.5 s bound stops the decode right after the third
    resize (frames 0, 5, 10): the bound is checked before each frame, so no frame's work starts past it."""
    now = [0.0]
    resized: list[tuple[int, ...]] = []
    real_resize = video_decode.resize_frame

    def slow_resize(frame: np.ndarray, plan: VideoFramePlan) -> np.ndarray:
        resized.append(frame.shape)
        now[0] += 1.0
        return real_resize(frame, plan)

    monkeypatch.setattr(video_decode, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(video_decode, "resize_frame", slow_resize)
    data = media_factory.video(64, 48, seconds=2, fps=10, codec="mpeg4")
    with pytest.raises(MediaError) as info:
        decode_video(data, VideoFramePlan(tuple(range(0, 20, 5)), 48, 64), LIMITS, timeout_s=2.5)
    assert info.value.reason == MediaReason.TIMEOUT
    assert "longer than 2.5s (at frame 11)" in str(info.value), str(info.value)
    assert len(resized) == 3


def test_decoders_refuse_frames_above_the_pixel_limit() -> None:
    data = media_factory.video(96, 60, seconds=0.5, fps=10, codec="mpeg4")
    with pytest.raises(MediaError) as info:
        decode_video(data, VideoFramePlan((0, 1), 60, 96), VideoLimits(max_frame_pixels=96 * 60 - 1), 10)
    assert info.value.reason in (MediaReason.PIXELS, MediaReason.CORRUPT)


def test_video_job_runs_in_the_pool() -> None:
    data = media_factory.video(97, 61, seconds=1, fps=10)
    plan = VideoFramePlan((0, 5), 252, 420)
    with PreprocessPool(1, 2) as pool:
        result = pool.submit_call(video_job, data, plan, LIMITS, 10.0, time.monotonic(), 0).result(timeout=120)
        assert result.frames.shape == (2, 252, 420, 3) and result.decode_s > 0
        failed = pool.submit_call(video_job, b"nope", plan, LIMITS, 10.0, time.monotonic(), 4)
        with pytest.raises(MediaError, match="video 4: "):
            failed.result(timeout=60)
    direct, _ = decode_video(data, plan, LIMITS, 10)
    assert np.array_equal(result.frames, direct)


# --- the preprocessing cache ------------------------------------------------------------------------------


def test_preprocess_cache_is_bounded_in_bytes_and_counts_hits() -> None:
    events: list[str] = []
    cache = PreprocessCache(4000, on_event=events.append)
    arrays = {f"k{i}": np.full(1000, i, np.uint8) for i in range(5)}
    for key, value in arrays.items():
        assert cache.put(key, value)
        assert cache.nbytes <= 4000
    assert cache.get("k0") is None and cache.get("k4") is arrays["k4"]  # k0 evicted first
    assert cache.get("k1") is arrays["k1"]
    cache.put("k5", np.zeros(1000, np.uint8))  # evicts k2, the least recently used (k1 was just read)
    assert cache.get("k2") is None and cache.get("k1") is not None
    assert not cache.put("big", np.zeros(1001, np.uint8))  # above a quarter of the budget: not kept
    assert events.count("hit") == 3 and events.count("miss") == 2
    off = PreprocessCache(0)
    assert not off.put("a", np.zeros(1, np.uint8)) and off.get("a") is None


def test_preprocess_key_covers_settings_plan_and_bytes() -> None:
    plan = VideoFramePlan((0, 2), 28, 28)
    base = preprocess_key("{}", plan, b"abc")
    assert base == preprocess_key("{}", VideoFramePlan((0, 2), 28, 28), b"abc")
    assert (
        len(
            {
                base,
                preprocess_key('{"a":1}', plan, b"abc"),
                preprocess_key("{}", plan, b"abd"),
                preprocess_key("{}", VideoFramePlan((0, 3), 28, 28), b"abc"),
            }
        )
        == 4
    )
