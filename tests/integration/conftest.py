"""Fixtures for tests that run the real services: a private Redis server and a started cluster."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from services.launch.local import free_port


@dataclass
class RedisServer:
    """A real redis-server of the test's own, so stopping it disturbs nobody else."""

    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server, "redis-server is required for integration tests"
        self.process = subprocess.Popen(
            [server, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


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
