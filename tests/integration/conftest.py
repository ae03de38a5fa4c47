"""Helpers for tests that run the real services: metric values, model folders (Redis: tests/conftest.py)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from tests.redis_server import RedisServer

__all__ = ["RedisServer", "metric_value", "model_folder", "module_cluster"]


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


def module_cluster(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, **spec: Any
) -> Iterator[LocalCluster]:
    """A module fixture's cluster (``yield from`` it): free ports, the module's Redis, logs in a temporary
    folder, ``spec`` for the rest of the `ClusterSpec`; stopped when the module is done."""
    local = start_cluster(
        ClusterSpec(
            model_dir, redis_url=redis_server.url, free_ports=True, log_dir=tmp_path_factory.mktemp("logs"), **spec
        )
    )
    try:
        yield local
    finally:
        local.stop()
