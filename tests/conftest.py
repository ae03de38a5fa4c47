"""Shared pytest fixtures."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.launch import local
from tests.redis_server import RedisServer

# Tests never reach a model hub: every model folder is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The `triton` attention backend's kernel runs on the CPU in Triton's interpreter (read when Triton first
# compiles a kernel's definition, so it is set before anything imports one; clusters inherit it).
os.environ.setdefault("TRITON_INTERPRET", "1")

# Clusters the tests start fork their services from one process that imported torch and transformers once
# (services/launch/forkserver.py): a cold `epd serve` spends ~3 CPU-seconds importing, per service, per start.
local.set_start_method("forkserver")

# How many clusters and service processes this test process started, printed at the end of the run: the
# suite's time is mostly theirs, so a change that adds starts shows in the summary.
STARTED = {"clusters": 0, "services": 0}


def _counted(function: Callable, key: str) -> Callable:
    @functools.wraps(function)
    def counting(*args: Any, **kwargs: Any) -> Any:
        STARTED[key] += 1
        return function(*args, **kwargs)

    return counting


local.start_cluster = _counted(local.start_cluster, "clusters")
local._popen = _counted(local._popen, "services")  # spawn and respawn call it


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(
        f"epd: {STARTED['clusters']} clusters and {STARTED['services']} service processes started by the tests"
    )


# Small image cap keeps vision forwards cheap; still several hundred tokens for large images.
TINY_TEST_MAX_PIXELS = 256 * 28 * 28
TINY_QWEN3_MAX_PIXELS = 256 * 32 * 32


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL folder (max_pixels 256*28*28), built once per test session."""
    from services.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vl"), "qwen2-vl", max_pixels=TINY_TEST_MAX_PIXELS)


@pytest.fixture(scope="session")
def tiny_model_dir_25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL folder (max_pixels 256*28*28), built once per test session."""
    from services.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), "qwen2.5-vl", max_pixels=TINY_TEST_MAX_PIXELS)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-VL folder (max_pixels 256*32*32: at most 256 tokens an image), built once per session."""
    from services.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-vl"), "qwen3-vl", max_pixels=TINY_QWEN3_MAX_PIXELS)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA-1.5 folder (CLIP 336/14: 576 tokens per image), built once per test session."""
    from services.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llava"), "llava")


FRESH_BUILDS = {
    "qwen2-vl": TINY_TEST_MAX_PIXELS,
    "llava": None,
    "qwen3-vl": TINY_QWEN3_MAX_PIXELS,
}
"""The tiny families `fresh_tiny_builds` builds again, and the max_pixels of each (None: its own)."""


@pytest.fixture(scope="session")
def fresh_tiny_builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`FRESH_BUILDS`, each built again into ``<folder>/<family>`` by another interpreter with another hash seed
    (one process for them all), for the tests that the build is byte for byte the session fixtures'."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("fresh-tiny-builds")
    script = (
        "import sys; from pathlib import Path; from services.models.tiny_model import make_tiny_model\n"
        f"for family, max_pixels in {FRESH_BUILDS!r}.items():\n"
        "    make_tiny_model(Path(sys.argv[1]) / family, family, max_pixels=max_pixels)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, cwd=root, env=env)
    return out


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server per test module (stopping it disturbs nobody else)."""
    from services.launch.local import free_port

    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()
