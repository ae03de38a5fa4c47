"""Fixtures for the engine tests: the tiny model loaded once per module, and one torch thread per op."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.models.registry import load_adapter


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One thread per op: tiny ops gain nothing from more, and a busy 2-core box stalls their sync."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The tiny Qwen2-VL's adapter and model (the module's engines install their attention on it)."""
    adapter = load_adapter(tiny_model_dir)
    return adapter, adapter.load_model()
