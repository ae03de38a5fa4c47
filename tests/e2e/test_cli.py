"""The `epd` command as a user runs it: `epd up`, then `generate` and `count`, then Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.launch.health import check
from tests import media_factory
from tests.integration.conftest import RedisServer


def _epd(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_up_generate_count_and_clean_stop(tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path) -> None:
    env = {**os.environ, "EPD_REDIS_URL": redis_server.url}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, "epd up exited early:\n" + "".join(lines)
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        assert "router (gRPC Generate) at 127.0.0.1:50051" in output, output
        assert check("127.0.0.1:50051")
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 3
        for service in psutil.Process(up.pid).children():
            # own process group (stopped as one), same session as `epd up`: Linux schedules sessions as
            # groups (autogroup), so only then does a worker's compute nice yield to the router
            assert os.getpgid(service.pid) == service.pid
            assert os.getsid(service.pid) == os.getsid(up.pid)
        image = tmp_path / "cat.png"
        image.write_bytes(media_factory.png(160, 120))
        generated = _epd("generate", "--image", str(image), "--max-tokens", "8", "What is this?", env=env)
        assert generated.returncode == 0, generated.stderr
        assert "completion 8" in generated.stdout or "[stop]" in generated.stdout, generated.stdout
        counted = _epd("count", "--image", str(image), "What is this?", env=env)
        assert counted.returncode == 0, counted.stderr
        fields = dict(line.split(" ", 1) for line in counted.stdout.strip().splitlines())
        assert int(fields["projected"]) == int(fields["prompt"]) + int(fields["max_tokens"])
        assert int(fields["image"]) > 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, f"left running: {child}"
    assert not check("127.0.0.1:50051", timeout_s=0.5)


@pytest.fixture(scope="module")
def redis_server() -> RedisServer:
    from services.launch.local import free_port

    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()
