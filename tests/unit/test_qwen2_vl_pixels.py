"""One-pass image pixels: the Qwen2-VL family's adapters turn an RGB image into exactly the pixel rows transformers'
own processor makes (Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's folders, random images of random sizes, resized or
not), the probe refuses a processor whose output differs, and an image the one pass does not cover (not RGB) takes
the processor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoImageProcessor

from services.models.loading import load_folder_parts
from services.models.qwen2_vl_pixels import probe_image_pixels
from services.models.registry import load_adapter

FOLDERS = ["tiny_model_dir", "tiny_model_dir_25", "tiny_qwen3_vl_dir"]


@pytest.fixture(scope="module", params=FOLDERS)
def adapter_and_processor(request: pytest.FixtureRequest) -> tuple:
    """(the folder's adapter, with the one pass in use, and the processor as transformers loads it)."""
    folder: Path = request.getfixturevalue(request.param)
    adapter = load_adapter(folder)
    assert adapter._pixels is not None  # the probe agreed
    return adapter, AutoImageProcessor.from_pretrained(folder, local_files_only=True)


@settings(max_examples=25, deadline=None)
@given(width=st.integers(8, 900), height=st.integers(8, 900), seed=st.integers(0, 2**16))
def test_pixel_rows_are_the_processors_own(adapter_and_processor: tuple, width: int, height: int, seed: int) -> None:
    adapter, processor = adapter_and_processor
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    ours = adapter.preprocess(image)
    theirs = processor(images=[image], return_tensors="pt")
    assert ours.grid_thw == tuple(int(v) for v in theirs["image_grid_thw"][0])
    assert ours.pixel_values.dtype == theirs["pixel_values"].dtype
    assert torch.equal(ours.pixel_values, theirs["pixel_values"])


def test_an_image_of_another_mode_takes_the_processor(tiny_model_dir: Path) -> None:
    adapter = load_adapter(tiny_model_dir)
    calls = []
    processor = adapter.image_processor
    own = processor.preprocess
    processor.preprocess = lambda *args, **kwargs: calls.append(1) or own(*args, **kwargs)  # what __call__ calls
    gray = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 90), dtype=np.uint8))
    pixels = adapter.preprocess(gray)
    assert len(calls) == 1
    assert torch.equal(pixels.pixel_values, own(images=[gray], return_tensors="pt")["pixel_values"])
    adapter.preprocess(gray.convert("RGB"))
    assert len(calls) == 1  # RGB: the one pass


def test_the_probe_refuses_a_processor_whose_output_differs(tiny_model_dir: Path) -> None:
    processor = load_folder_parts(tiny_model_dir).image_processor
    adapter = load_adapter(tiny_model_dir)
    args = (adapter.patch_size, adapter.merge_size, adapter.temporal_patch_size)

    def grid(width: int, height: int) -> tuple[int, int, int]:
        return adapter.image_tokens(width, height).grid_thw

    assert probe_image_pixels(processor, *args, grid) is not None
    processor.image_std = [s * 1.001 for s in processor.image_std]  # the processor's values move; a table of the
    processor.__dict__.pop("rescale", None)  # old ones would not, so the table is rebuilt from the new settings:
    processor.__dict__.pop("normalize", None)  # the probe must still agree
    assert probe_image_pixels(processor, *args, grid) is not None
    original = type(processor).patchify

    def shifted(self, image, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        patches, gh, gw = original(self, image, *a, **k)
        return patches + np.float32(1e-3), gh, gw

    processor.patchify = shifted.__get__(processor)
    assert probe_image_pixels(processor, *args, grid) is None
    processor.do_normalize = False
    assert probe_image_pixels(processor, *args, grid) is None  # a step the one pass always takes
