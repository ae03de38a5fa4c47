"""Encoder-side decode (colour, orientation, truncation, draft) and the bounded process pool."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

from services.common.image_decode import decode_image, load_image, to_rgb
from services.common.media import SUPPORTED_FORMATS, MediaError, MediaLimits, MediaReason, probe_image
from services.encoder.preprocess_pool import PreprocessPool, PreprocessSettings, QueueFull
from tests import media_factory as mf

LIMITS = MediaLimits(allowed_formats=SUPPORTED_FORMATS)
REPO = Path(__file__).resolve().parents[2]


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img).astype(np.int32)


def pil_reference(data: bytes) -> Image.Image:
    """What PIL alone gives: exif_transpose then convert('RGB')."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


# --- decode: size, orientation, colour -----------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        mf.png(20, 10),
        mf.png(20, 10, "L"),
        mf.png(20, 10, "1"),
        mf.jpeg(20, 10),
        mf.jpeg(20, 10, gray=True),
        mf.jpeg(20, 10, cmyk=True),
        mf.webp(20, 10),
        mf.bmp(20, 10),
        mf.tiff(20, 10, pages=2),
        mf.gif_frames(3, 20, 10),
        mf.apng(3),
    ],
)
def test_opaque_images_match_pil_convert_and_the_probed_size(data: bytes) -> None:
    img = load_image(data, LIMITS)
    header = probe_image(data, LIMITS)
    assert img.mode == "RGB"
    assert img.size == (header.width, header.height)
    assert np.array_equal(pixels(img), pixels(pil_reference(data)))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("exif_after_idat", [False, True])
def test_orientation_equals_exif_transpose(orientation: int, exif_after_idat: bool) -> None:
    for data in (
        mf.jpeg(30, 20, exif_orientation=orientation),
        mf.png(30, 20, exif_orientation=orientation, exif_after_idat=exif_after_idat),
    ):
        decoded = decode_image(data, LIMITS)
        assert decoded.image.size == (decoded.header.width, decoded.header.height)
        assert np.array_equal(pixels(decoded.image), pixels(pil_reference(data)))


def test_alpha_is_composited_on_white() -> None:
    data = mf.png(20, 10, "RGBA")
    src = np.asarray(Image.open(io.BytesIO(data))).astype(np.int32)
    out = pixels(load_image(data, LIMITS))
    assert (out[:5] == 255).all()  # fully transparent top half
    assert np.array_equal(out[5:, 10:], src[5:, 10:, :3])  # opaque quarter unchanged
    alpha = src[5:, :10, 3:] / 255.0
    blended = src[5:, :10, :3] * alpha + 255 * (1 - alpha)
    assert np.abs(out[5:, :10] - blended).max() <= 1


@pytest.mark.parametrize("mode", ["LA", "P"])
def test_grey_alpha_and_palette_transparency_composite_on_white(mode: str) -> None:
    data = mf.png(20, 10, mode)
    src = Image.open(io.BytesIO(data))
    transparent = np.asarray(src.convert("RGBA"))[..., 3] == 0
    out = pixels(load_image(data, LIMITS))
    assert transparent.any()
    assert (out[transparent] == 255).all()
    opaque = np.asarray(src.convert("RGBA"))[..., 3] == 255
    assert np.array_equal(out[opaque], np.asarray(src.convert("RGB")).astype(np.int32)[opaque])


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    data = mf.png(20, 10, "I;16")
    src = np.asarray(Image.open(io.BytesIO(data))).astype(np.int64)
    assert src.max() > 255  # a plain convert would saturate these
    out = pixels(load_image(data, LIMITS))
    assert np.array_equal(out[..., 0], src // 257)
    assert np.array_equal(out[..., 0], out[..., 2])


def test_modes_pil_cannot_convert_are_refused() -> None:
    with pytest.raises(MediaError) as info:
        to_rgb(Image.new("La", (2, 2)))
    assert info.value.reason is MediaReason.FORMAT


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data", [mf.png(64, 64), mf.jpeg(64, 64), mf.gif(64, 64), mf.bmp(64, 64), mf.tiff(32, 32), mf.webp(64, 64)]
)
def test_truncated_pixel_data_is_refused(data: bytes) -> None:
    with pytest.raises(MediaError) as info:
        load_image(mf.truncated(data, 0.8), LIMITS)
    assert info.value.reason is MediaReason.CORRUPT
    assert "truncated" in str(info.value)


def test_load_truncated_images_must_stay_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        load_image(mf.png(4, 4), LIMITS)


def test_pixel_cap_is_checked_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    loads = mf.record_pixel_decodes(monkeypatch)
    with pytest.raises(MediaError) as info:
        load_image(mf.png_declaring(50_000, 50_000), LIMITS)
    assert info.value.reason is MediaReason.PIXELS
    assert loads == []  # refused from the header: the decoder never ran
    load_image(mf.png(4, 4), LIMITS)
    assert loads == ["PNG"]  # and the recording sees a decode when there is one


# --- reduced-scale JPEG decode -------------------------------------------------------------------


def test_draft_is_off_by_default_and_opt_in() -> None:
    data = mf.jpeg(1600, 1200)
    full = decode_image(data, LIMITS)
    assert (full.draft_factor, full.image.size) == (1, (1600, 1200))
    assert decode_image(data, LIMITS, target_pixels=600_000).draft_factor == 1  # too close to bother
    small = decode_image(data, LIMITS, target_pixels=100_000)
    assert (small.draft_factor, small.image.size) == (2, (800, 600))
    assert (small.header.width, small.header.height) == (1600, 1200)  # token counts use the header
    diff = np.abs(pixels(small.image) - pixels(full.image.reduce(2)))
    assert diff.mean() < 4.0


def test_draft_respects_orientation_and_skips_other_formats() -> None:
    rotated = decode_image(mf.jpeg(1600, 1200, exif_orientation=6), LIMITS, target_pixels=20_000)
    assert rotated.draft_factor == 4
    assert rotated.image.size == (300, 400)
    png = decode_image(mf.png(800, 600), LIMITS, target_pixels=1_000)
    assert (png.draft_factor, png.image.size) == (1, (800, 600))


def test_target_pixels_is_validated() -> None:
    with pytest.raises(ValueError):
        decode_image(mf.png(4, 4), LIMITS, target_pixels=0)


# --- the process pool ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[PreprocessPool]:
    with PreprocessPool(workers=2, max_queue=8) as p:
        p.warm_up()
        yield p


def test_pool_decodes_like_load_image(pool: PreprocessPool) -> None:
    images = [mf.jpeg(40, 30, exif_orientation=6), mf.png(20, 10, "RGBA"), mf.gif_frames(4, 9, 7)]
    futures = [pool.submit(data, PreprocessSettings(LIMITS)) for data in images]
    for data, future in zip(images, futures, strict=True):
        result = future.result(timeout=30)
        assert np.array_equal(result.pixels, np.asarray(load_image(data, LIMITS)))
        assert result.pixels.shape == (result.header.height, result.header.width, 3)
        assert result.image().size == (result.header.width, result.header.height)
        assert result.decode_s >= 0 and result.queue_s >= 0
    assert pool.outstanding == 0


def test_pool_errors_propagate_as_media_error_and_release_slots(pool: PreprocessPool) -> None:
    future = pool.submit(mf.ico(), PreprocessSettings(LIMITS), index=4)
    with pytest.raises(MediaError) as info:
        future.result(timeout=30)
    assert (info.value.reason, str(info.value)) == (MediaReason.FORMAT, "image 4: unsupported format 'ICO'")
    with pytest.raises(ValueError):
        pool.submit_call(int, "not a number").result(timeout=30)
    assert pool.outstanding == 0


def test_children_never_import_torch(pool: PreprocessPool) -> None:
    heavy = "sorted(m for m in __import__('sys').modules if m.split('.')[0] in ('torch', 'transformers'))"
    assert pool.submit_call(eval, heavy).result(timeout=30) == []
    # And the job's own import chain never asks for them, even where they are installed.
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'): raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from services.encoder.preprocess_pool import preprocess_job, PreprocessSettings\n"
        "from tests import media_factory as mf\n"
        "print(preprocess_job(mf.jpeg(8, 8), PreprocessSettings(), 0.0).pixels.shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(8, 8, 3)"


def _held_until(release: Path) -> list[str]:
    """A command that runs until `release` exists (30 s at most): a job that holds its slot."""
    return ["sh", "-c", f'for _ in $(seq 3000); do [ -e "{release}" ] && exit 0; sleep 0.01; done; exit 1']


def test_full_queue_refuses_at_once_and_accepted_jobs_complete(tmp_path: Path) -> None:
    release = tmp_path / "release"
    with PreprocessPool(workers=1, max_queue=2) as small:
        small.warm_up()
        held = [small.submit_call(subprocess.run, _held_until(release)) for _ in range(2)]
        assert small.outstanding == 2
        for _ in range(200):
            with pytest.raises(QueueFull) as info:
                small.submit(mf.png(4, 4), PreprocessSettings(LIMITS))
            assert (info.value.outstanding, info.value.max_queue) == (2, 2)
        # Every refusal came while both slots were still held: none waited for a slot to free.
        assert not any(future.done() for future in held) and small.outstanding == 2
        release.touch()
        for future in held:
            assert future.result(timeout=60).returncode == 0
        assert small.outstanding == 0
        assert small.submit(mf.png(4, 4), PreprocessSettings(LIMITS)).result(timeout=30).header.width == 4


def test_pool_recovers_from_a_dead_child() -> None:
    with PreprocessPool(workers=1, max_queue=2) as small:
        with pytest.raises(BrokenProcessPool):
            small.submit_call(os._exit, 1).result(timeout=30)
        assert small.outstanding == 0
        assert small.submit(mf.png(4, 4), PreprocessSettings(LIMITS)).result(timeout=30).header.width == 4


def test_pool_validates_and_closes() -> None:
    for kwargs in ({"workers": 0, "max_queue": 1}, {"workers": 2, "max_queue": 1}):
        with pytest.raises(ValueError):
            PreprocessPool(**kwargs)
    with pytest.raises(ValueError, match="fork"):
        PreprocessPool(1, 1, mp_context="fork")
    closed = PreprocessPool(1, 1)
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.submit(mf.png(4, 4), PreprocessSettings(LIMITS))


def test_pool_processes_end_when_their_encoder_is_killed() -> None:
    """An encoder killed with SIGKILL leaves no decode processes behind: each notices its parent is gone and
    exits within about a second (they used to wait on their queue forever, reparented to init)."""
    import signal
    import time

    import psutil

    script = (
        "import sys, time, psutil\n"
        "from services.encoder.preprocess_pool import PreprocessPool\n"
        "pool = PreprocessPool(2, 4)\n"
        "pool.warm_up()\n"
        "kids = [p.pid for p in psutil.Process().children() if 'spawn_main' in ' '.join(p.cmdline())]\n"
        "print(' '.join(map(str, kids)), flush=True)\n"
        "time.sleep(600)\n"
    )
    encoder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        kids = [int(pid) for pid in encoder.stdout.readline().split()]
        assert len(kids) == 2, kids
        assert all(psutil.pid_exists(pid) for pid in kids)
    finally:
        encoder.send_signal(signal.SIGKILL)
        encoder.wait()
    deadline = time.monotonic() + 10
    alive = kids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in kids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        time.sleep(0.1)
    assert not alive, f"decode processes {alive} outlived their encoder"
