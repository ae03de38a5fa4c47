"""Every user error of the `epd` command, run as a user runs it: one line on stderr, no traceback, the exit code.

Exit 2: the command line is wrong (a bad flag or value, a missing or non-image file, a folder that is no model,
`--device cuda` without a GPU). Exit 1: something failed (no router, a port in use, no Redis, a service that died
during start-up). Every command here is a real `python -m services.cli` process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.launch.local import free_port
from tests import media_factory
from tests.integration.conftest import RedisServer

USAGE, FAILURE = 2, 1


def epd(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(result: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The single stderr line of a failed command, checked for `epd: error:`, the exit code and `needles`."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"want one line on stderr, got {len(lines)}:\n{result.stderr}"
    assert "Traceback" not in result.stderr + result.stdout
    assert lines[0].startswith("epd: error: "), lines[0]
    assert result.returncode == code, (result.returncode, lines[0])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def free_ports_args() -> list[str]:
    """Port flags that put every service of a 1+1 cluster on a free port (no HTTP, no metrics)."""
    return [
        "--port",
        str(free_port()),
        "--encoder-port",
        str(free_port()),
        "--worker-port",
        str(free_port()),
        "--http-port",
        "0",
        "--metrics-port",
        "0",
    ]


@pytest.fixture()
def image(tmp_path: Path) -> Path:
    path = tmp_path / "cat.png"
    path.write_bytes(media_factory.png(64, 48))
    return path


@pytest.mark.parametrize("command", ["generate", "count"])
def test_missing_image_file(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "cat.jpg"
    error_line(
        epd(command, "--image", str(missing), "hi"),
        USAGE,
        f"image file {missing} not found",
        "give a path to an existing image",
    )


def test_a_file_that_is_not_an_image(tmp_path: Path) -> None:
    text = tmp_path / "cat.jpg"
    text.write_text("not a picture\n")
    error_line(epd("generate", "--image", str(text), "hi"), USAGE, "is not an image", "PNG")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    error_line(epd("count", "--image", str(empty), "hi"), USAGE, "is empty")
    error_line(epd("count", "--image", str(tmp_path), "hi"), USAGE, "is a folder")


@pytest.mark.parametrize("command", ["generate", "count"])
def test_unreachable_router(command: str, image: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    result = epd(command, "--address", address, "--image", str(image), "hi", timeout=60)
    error_line(result, FAILURE, f"no router listens at {address}", "epd up", "--address")


def test_bad_values_are_usage_errors() -> None:
    error_line(epd("generate", "--image-url", "cat.jpg", "hi"), USAGE, "--image-url", "data:", "--image")
    error_line(epd("generate", "--max-tokens", "0", "hi"), USAGE, "--max-tokens", "above 0")
    error_line(epd("generate", "--top-p", "1.5", "hi"), USAGE, "--top-p")
    error_line(epd("count", "--timeout", "soon", "hi"), USAGE, "--timeout")
    error_line(epd("up", "--port", "70000"), USAGE, "--port", "65535")
    error_line(epd("up", "--no-such-flag"), USAGE, "unrecognized arguments: --no-such-flag", "--help")
    error_line(epd(), USAGE, "COMMAND")


def test_device_gpu_is_not_a_choice() -> None:
    error_line(epd("up", "--device", "gpu"), USAGE, "--device", "'gpu'", "cpu", "cuda")


def test_device_cuda_without_a_gpu(tiny_model_dir: Path) -> None:
    """An empty `CUDA_VISIBLE_DEVICES` hides any GPU, so the refusal is checked on a GPU box too."""
    error_line(
        epd("up", "--device", "cuda", "--model", str(tiny_model_dir), env={"CUDA_VISIBLE_DEVICES": ""}),
        USAGE,
        "--device cuda",
        "sees no CUDA GPU",
        "--device cpu",
    )


def test_model_folder_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = epd("up", "--model", str(tmp_path), *free_ports_args())
    error_line(result, USAGE, f"model folder {tmp_path} has no config.json", "--model")
    assert "starting" not in result.stdout, "the check must come before anything starts"


def test_model_folder_of_an_unknown_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    error_line(epd("up", "--model", str(tmp_path)), USAGE, "'llama'", "qwen2_vl")
    error_line(epd("up", "--model", str(tmp_path / "nowhere")), USAGE, "does not exist")


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--encoder-port", "--worker-port", "--metrics-port"])
def test_port_in_use(flag: str, tiny_model_dir: Path, redis_server: RedisServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = free_ports_args()
        if flag in args:
            args[args.index(flag) + 1] = port
        else:
            args += [flag, port]
        result = epd("up", "--model", str(tiny_model_dir), *args, env={"EPD_REDIS_URL": redis_server.url})
    error_line(result, FAILURE, f"port {port} (", "already in use", flag)
    assert "starting" not in result.stdout


def test_no_redis_to_be_had(tiny_model_dir: Path) -> None:
    url = "redis://192.0.2.1:6379/0"  # TEST-NET-1: never answers, and not this box's to start
    result = epd("up", "--model", str(tiny_model_dir), *free_ports_args(), env={"EPD_REDIS_URL": url})
    error_line(result, FAILURE, f"no Redis answers at {url}", "EPD_REDIS_URL")


def test_a_service_that_dies_during_start_up(tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path) -> None:
    """config.json passes the checks, but there is no tokenizer or weight: the services exit while starting."""
    broken = tmp_path / "config-only"
    broken.mkdir()
    shutil.copy(tiny_model_dir / "config.json", broken / "config.json")
    result = epd("up", "--model", str(broken), *free_ports_args(), env={"EPD_REDIS_URL": redis_server.url}, timeout=240)
    line = error_line(result, FAILURE, "exited with code", "during start-up", "its log", "the log folder is kept")
    log = Path(line.split("its log ", 1)[1].split(" ends: ", 1)[0])
    try:
        assert log.is_file() and log.read_text(), line
        assert "Traceback" in log.read_text(), "a service's log keeps its traceback"
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)


def test_startup_timeout(tiny_model_dir: Path, redis_server: RedisServer) -> None:
    result = epd(
        "up",
        "--model",
        str(tiny_model_dir),
        "--startup-timeout",
        "0.5",
        *free_ports_args(),
        env={"EPD_REDIS_URL": redis_server.url},
    )
    line = error_line(result, FAILURE, "was not healthy within 0.5s", "--startup-timeout")
    shutil.rmtree(Path(line.split("its log ", 1)[1].split(" ends: ", 1)[0]).parent, ignore_errors=True)


def test_version_and_help() -> None:
    from importlib.metadata import version

    result = epd("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"epd {version('epd')}", result
    for command in ("up", "generate", "count", "demo"):
        shown = epd(command, "--help")
        assert shown.returncode == 0 and "--debug" in shown.stdout, shown


def test_ctrl_c_during_start_up_stops_everything(tiny_model_dir: Path, redis_server: RedisServer) -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir), *free_ports_args()],
        env={**os.environ, "EPD_REDIS_URL": redis_server.url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = up.stdout.readline()  # "starting ...; logs in DIR (...)": the services are being spawned
    deadline = time.monotonic() + 30
    while len(services := psutil.Process(up.pid).children()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    up.send_signal(signal.SIGINT)
    try:
        out, err = up.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # seen once in CI, never since: where its threads were, for the next time
        up.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        up.kill()
        out, err = up.communicate()
        pytest.fail(f"epd up still ran 60 s after Ctrl-C; stdout:\n{out}\nits threads (SIGUSR1):\n{err[-6000:]}")
    assert up.returncode == 130 and err == "epd: error: interrupted\n", (up.returncode, err)
    assert "ready:" not in out, "interrupted before any service was ready"
    log_dir = Path(first.split("logs in ", 1)[1].split()[0])
    assert not log_dir.exists(), f"left {log_dir}"
    assert len(services) == 3
    assert psutil.wait_procs(services, timeout=10)[1] == [], "a service outlived epd up"


def test_a_cancelled_start_stops_what_it_started(tiny_model_dir: Path, redis_server: RedisServer) -> None:
    """`start_cluster` on a thread of its caller's (a bench's), which Ctrl-C cannot reach: once `cancelled` is set
    its wait for health ends and every service it spawned is stopped before it raises (the launcher's fork server
    itself, kept for this process's later starts, is not a service; what it forked is)."""
    import threading

    from services.launch.local import ClusterSpec, StartCancelled, start_cluster

    def running() -> dict[int, str]:
        found = {}
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                command = " ".join(process.cmdline())
                server = process.ppid() == os.getpid() and "services.launch.forkserver" in command  # its forks: kept
                if process.status() != psutil.STATUS_ZOMBIE and not server:
                    found[process.pid] = command
        return found

    before = running()
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(StartCancelled):
        start_cluster(ClusterSpec(tiny_model_dir, redis_url=redis_server.url, free_ports=True), cancelled=cancelled)
    left = {pid: command for pid, command in running().items() if pid not in before}
    assert left == {}, left


def test_a_bench_stopped_with_sigterm_stops_its_services() -> None:
    """`timeout` or `kill` stops `epd bench` with SIGTERM: the bench gets it as an interrupt and stops the cluster
    it was starting, so no service outlives it (its services run in process groups of their own)."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "bench", "burst", "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    services: list[psutil.Process] = []
    while len(services) < 3 and time.monotonic() < deadline and bench.poll() is None:
        tree = psutil.Process(bench.pid).children(recursive=True)
        serving = {p.pid for p in tree if "services.cli serve" in " ".join(p.cmdline())}
        services = [p for p in tree if p.pid in serving and p.ppid() not in serving]  # not a worker's forked engine
        time.sleep(0.05)
    assert len(services) == 3, "the bench started no cluster"
    descendants = psutil.Process(bench.pid).children(recursive=True)
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=90)
    assert bench.returncode == 130, (bench.returncode, err[-2000:])
    assert psutil.wait_procs(descendants, timeout=15)[1] == [], "a process outlived epd bench"
