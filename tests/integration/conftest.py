"""Helpers for tests that run the real services: metric values, model folders (Redis: tests/conftest.py)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tests.redis_server import RedisServer

__all__ = ["RedisServer", "metric_value", "model_folder"]


def metric_value(port: int, name: str) -> float:
    """Sum of all samples of `name` on a service's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def model_folder(tmp_root: Path, name: str, family: str = "qwen2-vl", max_pixels: int | None = None) -> Path:
    from services.models.tiny_model import make_tiny_model

    path = tmp_root / name
    if not (path / "config.json").exists():
        make_tiny_model(path, family, max_pixels=max_pixels)
    return path
