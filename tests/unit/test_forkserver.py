"""services/launch/forkserver.py through `local.spawn` (the suite's start method): a forked `epd serve` takes
the environment, working directory, log and process group it was given, answers like a `Popen` (wait,
signals, exit codes) and keeps the launcher's environment of the moment the start method was chosen; a
service whose settings the preloaded modules could have read at import is exec'd instead."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from services.launch import forkserver, local
from services.launch.health import wait_healthy
from tests.redis_server import RedisServer


def test_a_forked_service_runs_in_the_given_folder_with_the_given_settings_and_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-a-folder").write_text("")  # found only relative to this working directory
    process = local.spawn("worker", local.free_port(), 0, {"EPD_MODEL": "not-a-folder"}, tmp_path)
    assert isinstance(process.popen, forkserver.ForkedProcess)
    assert process.popen.wait(120) == 2  # a usage error, from the EPD_MODEL it was given
    assert "model folder not-a-folder is a file, not a folder" in process.log_tail()
    assert process.popen.poll() == 2 and "serve" in process.popen.args and "worker" in process.popen.args


def test_a_forked_service_serves_in_its_own_group_and_answers_signals(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {"EPD_MODEL": str(tiny_model_dir), "EPD_REDIS_URL": redis_server.url, "EPD_TORCH_THREADS": "1"}
    first = local.spawn("worker", local.free_port(), 0, env, tmp_path)
    second = local.spawn("worker", local.free_port(), 0, env, tmp_path)
    try:
        for process in (first, second):
            wait_healthy(process.address, 120, alive=lambda p=process: p.popen.poll() is None)
            assert os.getpgid(process.popen.pid) == process.popen.pid
        with pytest.raises(subprocess.TimeoutExpired):
            first.popen.wait(0.1)
        first.popen.terminate()  # SIGTERM: a drain, then a clean exit
        second.popen.kill()
        assert first.popen.wait(60) == 0 and second.popen.wait(60) == -signal.SIGKILL
        first.popen.kill()  # after the exit: nothing to signal, nothing raised
    finally:
        for process in (first, second):
            process.popen.kill()
            process.popen.wait(60)


def test_a_service_whose_settings_the_imports_may_have_read_is_execd(tmp_path: Path) -> None:
    env = {"EPD_MODEL": str(tmp_path / "none"), "HF_HOME": str(tmp_path / "hf")}  # huggingface_hub reads HF_HOME
    process = local.spawn("worker", local.free_port(), 0, env, tmp_path)  # when it is imported
    assert isinstance(process.popen, subprocess.Popen)
    assert process.popen.wait(120) == 2 and "does not exist" in process.log_tail()


def test_what_the_launcher_sets_later_does_not_reach_a_forked_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Libraries in the launcher set variables (Ray, torch's compile cache): the forked services keep the
    environment of the moment the start method was chosen, and are still forked."""
    monkeypatch.setenv("EPD_MODEL", str(tmp_path / "set-later"))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    process = local.spawn("worker", local.free_port(), 0, {}, tmp_path)
    assert isinstance(process.popen, forkserver.ForkedProcess)
    assert process.popen.wait(120) == 2 and "set-later" not in process.log_tail()
