"""`epd up --tensor-parallel-size 2` as a user runs it: each worker spans two rank processes (gloo on the CPU) and
the cluster's greedy answers equal `generate`; Ctrl-C ends every process. A size the model cannot split is one
usage line before anything starts; a rank that cannot start fails `epd up` with one line naming it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from services.client import Client, user_request
from tests import media_factory
from tests.e2e.test_cli_errors import FAILURE, USAGE, epd, error_line, free_ports_args
from tests.integration.conftest import RedisServer
from tests.integration.test_skeleton import MAX_TOKENS, expected


def test_up_with_tensor_parallel_size_2_answers_as_generate(tiny_model_dir: Path, redis_server: RedisServer) -> None:
    ports = free_ports_args()
    router = f"127.0.0.1:{ports[ports.index('--port') + 1]}"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2",
         "--startup-timeout", "900", *ports],
        env={**os.environ, "EPD_REDIS_URL": redis_server.url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 900  # a loaded 2-core box starts five interpreters
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, "epd up exited early:\n" + "".join(lines)
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        worker = next(c for c in psutil.Process(up.pid).children() if "worker" in " ".join(c.cmdline()))
        ranks = [c for c in worker.children() if "multiprocessing.spawn" in " ".join(c.cmdline())]
        ranks = [c for c in ranks if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(ranks) == 1, [c.cmdline() for c in worker.children()]
        everything = psutil.Process(up.pid).children(recursive=True)
        client = Client(router)
        try:
            for images, prompt in [
                ([media_factory.png(64, 96, seed=5), media_factory.jpeg(150, 80, seed=6)], "Compare them."),
                ([media_factory.jpeg(300, 200, seed=7)], "What is in the picture?"),
                ([], "Hello there"),
            ]:
                answer = client.generate(user_request(prompt, images, max_tokens=MAX_TOKENS))
                assert answer.token_ids == expected(tiny_model_dir, images, prompt), prompt
        finally:
            client.close()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, "".join(lines)
    for process in everything:
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, f"left running: {process}"


def test_a_size_the_model_cannot_split_is_one_usage_line(tiny_model_dir: Path) -> None:
    result = epd("up", "--model", str(tiny_model_dir), "--tensor-parallel-size", "3", *free_ports_args())
    error_line(result, USAGE, "--tensor-parallel-size 3: tensor_parallel_size 3 does not divide over the model's 2 KV")
    assert "starting" not in result.stdout


def test_a_rank_that_cannot_start_fails_up_with_one_line(tiny_model_dir: Path, redis_server: RedisServer) -> None:
    """Ranks given 0.01 s to start (EPD_TENSOR_PARALLEL_START_TIMEOUT_S): rank 1 does not report in time, the
    worker exits, and `epd up` says so in one line ending with the worker's last log line, which names the rank."""
    result = epd(
        "up", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2", "--startup-timeout", "900",
        *free_ports_args(),
        env={"EPD_REDIS_URL": redis_server.url, "EPD_TENSOR_PARALLEL_START_TIMEOUT_S": "0.01"}, timeout=900,
    )  # fmt: skip
    line = error_line(result, FAILURE, "the worker at", "exited", "tensor-parallel rank 1 did not report loaded")
    shutil.rmtree(Path(line.split("its log ", 1)[1].split(" ends: ", 1)[0]).parent, ignore_errors=True)
