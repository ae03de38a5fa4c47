"""The pixel table: an image processor's rescale and normalise as one lookup gives exactly the processor's own pixel
values (Qwen2-VL's, Qwen3-VL's and Llava's processors, random images of random sizes and modes), is installed only
where the probe agrees, and leaves inputs it does not cover to the processor's own methods."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoImageProcessor

from services.models.loading import load_folder_parts
from services.models.pixel_table import PixelTable, install_pixel_table

FOLDERS = ["tiny_model_dir", "tiny_qwen3_vl_dir", "tiny_llava_dir"]


@pytest.fixture(scope="module", params=FOLDERS)
def processors(request: pytest.FixtureRequest) -> tuple:
    """(the folder's processor as epd loads it, the same processor as transformers loads it)."""
    folder: Path = request.getfixturevalue(request.param)
    ours = load_folder_parts(folder).image_processor
    assert "rescale" in vars(ours) and "normalize" in vars(ours)  # the probe agreed: the table is installed
    return ours, AutoImageProcessor.from_pretrained(folder, local_files_only=True)


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(8, 700),
    height=st.integers(8, 700),
    mode=st.sampled_from(["RGB", "L", "RGBA"]),
    seed=st.integers(0, 2**16),
)
def test_pixel_values_are_the_processors_own(processors: tuple, width: int, height: int, mode: str, seed: int) -> None:
    ours, theirs = processors
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA").convert(mode)
    if mode != "RGB" and not getattr(theirs, "do_convert_rgb", True):
        image = image.convert("RGB")
    got = ours(images=[image], return_tensors="np")
    expected = theirs(images=[image], return_tensors="np")
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].dtype == expected[key].dtype and np.array_equal(got[key], expected[key]), key


def test_inputs_the_table_does_not_cover_take_the_processors_methods(tiny_model_dir: Path) -> None:
    processor = AutoImageProcessor.from_pretrained(tiny_model_dir, local_files_only=True)
    table = PixelTable(processor)
    floats = np.random.default_rng(1).random((3, 8, 8), dtype=np.float32)
    assert np.array_equal(
        table.normalize(table.rescale(floats, table.scale), table.mean, table.std),
        processor.normalize(processor.rescale(floats, table.scale), table.mean, table.std),
    )
    other_scale = np.full((3, 4, 4), 7, dtype=np.uint8)
    assert np.array_equal(table.rescale(other_scale, 0.5), processor.rescale(other_scale, 0.5))
    looked_up = table.rescale(other_scale, table.scale)
    with pytest.raises(ValueError, match="another mean or std"):
        table.normalize(looked_up, [0.5, 0.5, 0.5], table.std)


def test_a_processor_that_does_not_rescale_keeps_its_own_methods(tiny_model_dir: Path) -> None:
    processor = AutoImageProcessor.from_pretrained(tiny_model_dir, local_files_only=True, do_rescale=False)
    assert not install_pixel_table(processor)
    assert "rescale" not in vars(processor) and "normalize" not in vars(processor)
    assert not install_pixel_table(None)
