"""The `epd` command as a user runs it: `epd up`, then `generate` and `count`, then Ctrl-C stops all."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from services.launch.health import check, wait_healthy
from tests import media_factory
from tests.integration.conftest import RedisServer


def _epd(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_up_generate_count_and_clean_stop(tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path) -> None:
    env = {**os.environ, "EPD_REDIS_URL": redis_server.url}
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
        log_dir = readiness(output)
        assert "router (gRPC Generate) at 127.0.0.1:50051" in output, output
        assert check("127.0.0.1:50051")
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 3
        for service in psutil.Process(up.pid).children():
            # own process group (stopped as one), same session as `epd up`: Linux schedules sessions as
            # groups (autogroup), so only then does a worker's compute nice yield to the router
            assert os.getpgid(service.pid) == service.pid
            assert os.getsid(service.pid) == os.getsid(up.pid)
        worker = next(c for c in psutil.Process(up.pid).children() if "worker" in c.cmdline())
        engines = [c for c in worker.children() if c.name() == "epd-engine"]
        assert len(engines) == 1 and engines[0].cmdline() == worker.cmdline(), "the worker's engine was not forked"
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
        check_json_and_flags(image, env)
        check_supervision(up, lines, image, env)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, f"left running: {child}"
    assert not check("127.0.0.1:50051", timeout_s=0.5)
    assert not log_dir.exists(), f"epd up left its temporary folder {log_dir}"


def check_supervision(up: subprocess.Popen, lines: list[str], image: Path, env: dict[str, str]) -> None:
    """`epd up` supervises: a worker killed with SIGKILL is reported in one line, started again, and serves."""
    worker = next(c for c in psutil.Process(up.pid).children() if "worker" in c.cmdline())
    worker.kill()
    reported: list[str] = []
    while not any("restarted: worker" in line for line in reported):
        line = up.stdout.readline()
        assert line, "epd up exited:\n" + "".join(lines + reported)
        reported.append(line)
    exited = [line for line in reported if "exited:" in line]
    assert len(exited) == 1 and "worker" in exited[0] and "code -9" in exited[0], reported
    restarted = next(c for c in psutil.Process(up.pid).children() if "worker" in c.cmdline())
    assert restarted.pid != worker.pid
    wait_healthy("127.0.0.1:50071", 180, restarted.is_running)
    generated = _epd("generate", "--image", str(image), "--max-tokens", "4", "Again?", env=env)
    assert generated.returncode == 0, generated.stderr


def readiness(output: str) -> Path:
    """One `ready:` line per service (the router's with both APIs); returns the temporary log folder named."""
    ready = [line.split() for line in output.splitlines() if line.strip().startswith("ready:")]
    assert sorted(words[1] for words in ready) == ["encoder", "router", "worker"], output
    router = next(line for line in output.splitlines() if "ready: router" in line)
    assert "gRPC Generate at 127.0.0.1:50051" in router and "OpenAI HTTP at http://127.0.0.1:8000/v1" in router, router
    log_dir = Path(output.split("logs in ", 1)[1].split()[0])
    assert log_dir.is_dir() and any(log_dir.glob("router-*.log")), output
    return log_dir


def check_json_and_flags(image: Path, env: dict[str, str]) -> None:
    """`--json` prints one object; the request flags reach the router; a refused request is one line, exit 1."""
    data_url = "data:image/png;base64," + base64.b64encode(media_factory.png(96, 64)).decode()
    generated = _epd(
        "generate",
        "--json",
        "--image",
        str(image),
        "--image-url",
        data_url,
        "--system",
        "Be brief.",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "7",
        "--stop",
        "zzz",
        "--cache-salt",
        "t1",
        "--timeout",
        "60",
        "What is this?",
        env=env,
    )
    assert generated.returncode == 0, generated.stderr
    answer = json.loads(generated.stdout)
    assert set(answer) >= {"text", "token_ids", "finish_reason", "usage", "timing"}, answer
    assert answer["usage"]["completion_tokens"] == len(answer["token_ids"]) <= 6
    assert answer["finish_reason"] in ("stop", "length") and answer["timing"]["total_s"] > 0
    counted = _epd("count", "--json", "--image", str(image), "--image-url", data_url, "What is this?", env=env)
    assert counted.returncode == 0, counted.stderr
    count = json.loads(counted.stdout)
    assert len(count["tokens_per_item"]) == 2 and count["image_tokens"] == sum(count["tokens_per_item"]) > 0
    assert count["projected_tokens"] == count["prompt_tokens"] + count["max_tokens"]
    assert answer["usage"]["image_tokens"] == count["image_tokens"]
    refused = _epd("generate", "--max-tokens", "10000000", "hi", env=env)
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith("epd: error: ") and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
