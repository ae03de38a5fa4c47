"""The `epd` parser, the request it builds, the port plan and the checks `epd up` runs before starting anything."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services import cli_stop
from services.cli import _parser, main
from services.cli_errors import FAILURE, USAGE, UserError, one_line
from services.cli_request import build_request, read_image, read_video
from services.cli_up import log_verdict, port_rows
from services.launch.local import ClusterSpec, plan_ports, torch_threads
from services.launch.preflight import check_model, check_ports, port_in_use, resolve_device
from tests import media_factory


def parsers(parser: argparse.ArgumentParser, path: str = "epd") -> list[tuple[str, argparse.ArgumentParser]]:
    """`parser` and every subcommand parser below it, with the command line that reaches each."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += parsers(sub, f"{path} {name}")
    return found


def test_every_flag_and_argument_has_help() -> None:
    missing = [
        f"{path} {action.option_strings or action.dest}"
        for path, parser in parsers(_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]
    assert missing == []


def test_usage_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parser().parse_args(["up", "--device", "gpu"])
    assert exited.value.code == USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'gpu'" in err and "'cpu', 'cuda'" in err, err


def test_main_turns_a_user_error_into_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--image", str(tmp_path / "none.png"), "hi"]) == USAGE
    err = capsys.readouterr().err
    assert err == f"epd: error: image file {tmp_path / 'none.png'} not found (give a path to an existing image)\n"


def test_up_flags_default_to_the_documented_ports() -> None:
    args = _parser().parse_args(["up"])
    assert (args.port, args.http_port, args.encoder_port, args.worker_port, args.metrics_port) == (
        50051,
        8000,
        50061,
        50071,
        9400,
    )
    assert args.startup_timeout == 180.0 and args.device is None


def test_up_takes_no_encoder_for_a_co_located_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parser().parse_args(["up", "--encoders", "0"]).encoders == 0
    assert plan_ports(ClusterSpec(Path("m"), encoders=0, metrics_port=0)).encoders == ()
    with pytest.raises(SystemExit):
        _parser().parse_args(["up", "--encoders", "-1"])
    assert "--encoders" in capsys.readouterr().err


def test_threads_split_the_cores_over_the_services_that_compute() -> None:
    assert torch_threads(ClusterSpec(Path("m")), 2) == 1  # an encoder and a worker: a core each
    assert torch_threads(ClusterSpec(Path("m"), encoders=0), 2) == 1  # a worker that encodes counts twice
    assert torch_threads(ClusterSpec(Path("m"), encoders=0, workers=2), 8) == 2
    assert torch_threads(ClusterSpec(Path("m"), encoders=2, workers=2, prefill_workers=4), 16) == 2
    assert torch_threads(ClusterSpec(Path("m"), encoders=4, workers=4), 2) == 1  # never none


def test_port_plan_counts_up_from_each_base() -> None:
    plan = plan_ports(
        ClusterSpec(
            Path("m"),
            encoders=2,
            workers=2,
            router_port=7000,
            http_port=0,
            encoder_port=7100,
            worker_port=7200,
            metrics_port=7300,
        )
    )
    assert (plan.router, plan.http, plan.encoders, plan.workers) == (7000, 0, (7100, 7101), (7200, 7201))
    assert plan.metrics == (7300, 7301, 7302, 7303, 7304)
    rows = port_rows(plan)
    assert ("router gRPC", 7000, "--port") in rows and ("worker gRPC", 7201, "--worker-port") in rows
    assert all(port != 0 for _, port, _ in rows), "an endpoint that is off binds nothing"
    assert plan_ports(ClusterSpec(Path("m"), metrics_port=0)).metrics == (0, 0, 0)


def test_check_ports_names_the_flag_of_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(UserError) as raised:
            check_ports([("router gRPC", port, "--port")])
    assert raised.value.exit_code == FAILURE
    assert raised.value.message == (
        f"port {port} (router gRPC) is already in use (stop what listens there, or pass --port with a free port)"
    )
    with pytest.raises(UserError) as twice:
        check_ports([("router gRPC", 7000, "--port"), ("metrics", 7000, "--metrics-port")])
    assert twice.value.exit_code == USAGE and "both" in twice.value.message


def test_check_model(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="has no config.json") as raised:
        check_model(tmp_path)
    assert raised.value.exit_code == USAGE
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot be used"):
        check_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    assert check_model(tmp_path) == "qwen2_vl"


def test_device_comes_from_the_flag_then_epd_device() -> None:
    assert resolve_device(None, {}) == "cpu"
    assert resolve_device(None, {"EPD_DEVICE": "cuda"}) == "cuda"
    assert resolve_device("cpu", {"EPD_DEVICE": "cuda"}) == "cpu"
    with pytest.raises(UserError, match="EPD_DEVICE=gpu") as raised:
        resolve_device(None, {"EPD_DEVICE": "gpu"})
    assert raised.value.exit_code == USAGE


def test_request_from_flags(tmp_path: Path) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(media_factory.png(32, 32))
    args = _parser().parse_args(
        [
            "generate",
            "--system",
            "Be brief.",
            "--image",
            str(image),
            "--image-url",
            "https://example.com/b.png",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--seed",
            "3",
            "--stop",
            "x",
            "--stop",
            "y",
            "--cache-salt",
            "s",
            "--temperature",
            "0.5",
            "--max-tokens",
            "9",
            "Describe.",
        ]
    )
    request = build_request(args)
    system, user = request.messages
    assert (system.role, system.content[0].text) == ("system", "Be brief.")
    assert user.role == "user"
    assert [part.WhichOneof("part") for part in user.content] == ["image", "image", "text"]
    assert user.content[0].image.data == image.read_bytes()
    assert user.content[1].image.url == "https://example.com/b.png" and user.content[2].text == "Describe."
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, list(sampling.stop)) == (9, 5, 3, ["x", "y"])
    assert sampling.top_p == pytest.approx(0.9) and sampling.temperature == pytest.approx(0.5)
    assert request.cache_salt == "s"


def test_read_image_refuses_what_is_not_an_image(tmp_path: Path) -> None:
    text = tmp_path / "cat.jpg"
    text.write_text("hello")
    for path, message in ((text, "is not an image"), (tmp_path, "is a folder"), (tmp_path / "no.png", "not found")):
        with pytest.raises(UserError, match=message) as raised:
            read_image(path)
        assert raised.value.exit_code == USAGE


def test_videos_go_after_the_images_and_must_be_videos(tmp_path: Path) -> None:
    clip, image = tmp_path / "clip.webm", tmp_path / "a.png"
    clip.write_bytes(media_factory.video(64, 48, seconds=1, fps=10, container="webm"))
    image.write_bytes(media_factory.png(8, 8))
    args = _parser().parse_args(["count", "--image", str(image), "--video", str(clip), "What happens?"])
    user = build_request(args).messages[0]
    assert [part.WhichOneof("part") for part in user.content] == ["image", "video", "text"]
    assert user.content[1].video.data == clip.read_bytes()
    for path, message in (
        (image, "is not an MP4 or WebM"),
        (tmp_path, "is a folder"),
        (tmp_path / "no.mp4", "not found"),
    ):
        with pytest.raises(UserError, match=f"video file .*{message}") as raised:
            read_video(path)
        assert raised.value.exit_code == USAGE


def test_one_line() -> None:
    assert one_line("a\n  b\tc\n") == "a b c"
    assert len(one_line("x" * 1000, 50)) == 50


def test_the_reason_a_service_ended_is_its_own_error_line_not_a_helpers_later_warning() -> None:
    """A tensor-parallel worker's log as `epd up` may read it: the worker's `epd: error:` line, then (written by
    multiprocessing's resource tracker after the worker exited, so present or not depending on timing) a leak
    warning. Either way the failure names the worker's error; a log without such a line gives its last line."""
    error = "epd: error: `epd serve` failed unexpectedly: RankStartError: tensor-parallel rank 1 did not report loaded"
    tracker = (
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear "
        "to be 1 leaked semaphore objects to clean up at shutdown\n  warnings.warn('resource_tracker: There appear'"
    )
    traceback = "Traceback (most recent call last):\n  File x\nRankStartError: tensor-parallel rank 1 did not report"
    assert log_verdict(f"{traceback}\n{error}\n") == error
    assert log_verdict(f"{traceback}\n{error}\n{tracker}\n\n") == error
    assert log_verdict("starting\nValueError: no such model\n\n") == "ValueError: no such model"
    assert log_verdict("\n") == "(empty)"


def test_the_cli_loads_without_torch() -> None:
    """Client commands (`epd --version`, `generate`, `count`) start without torch or transformers: the worker's
    settings, which `epd up` reads, are declared torch-free."""
    import subprocess
    import sys

    code = "import sys, services.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--image", "{image}", "--max-tokens", "4", "What is this?"],
        ["count", "--image", "{image}", "hi"],
        ["health", "{address}"],
        ["generate", "--help"],
    ],
    ids=["generate", "count", "health", "help"],
)
def test_client_commands_run_without_torch(argv: list[str], tmp_path: Path) -> None:
    """A client command run to its end (flags parsed, the image read and sniffed, the request built, the
    router dialled: nothing listens, so it fails there) loads neither torch nor transformers."""
    from tests import media_factory

    image = tmp_path / "cat.png"
    image.write_bytes(media_factory.png(32, 32, seed=1))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens there
    args = [a.format(image=image, address=address) for a in argv]
    if argv[0] in ("generate", "count") and "--help" not in argv:
        args += ["--address", address]
    done = _run_cli_noting_torch(args)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    if "--help" not in argv:
        assert done.returncode == 1, done.stdout + done.stderr  # it got as far as the call


def test_up_checks_its_model_folder_and_ports_without_torch(tiny_model_dir: Path) -> None:
    """`epd up`'s checks (device, model folder and its family, ports) run before anything starts and load neither
    torch nor transformers: a port in use is reported in about a second, not after the model code's imports."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run_cli_noting_torch(["up", "--model", str(tiny_model_dir), "--port", str(port)])
    assert done.returncode == 1 and f"port {port} (router gRPC) is already in use" in done.stderr, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def _run_cli_noting_torch(args: list[str]) -> subprocess.CompletedProcess:
    """`epd ARGS` in a fresh interpreter whose last stdout line lists which of torch and transformers it loaded."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
        "from services.cli import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_ctrl_c_whose_interrupt_is_swallowed_during_start_up_is_still_seen() -> None:
    """`epd up`'s start-up handler raises KeyboardInterrupt and remembers the signal: a gRPC channel's `__del__`
    silences every exception with a bare `except`, and a Ctrl-C raised there must still end start-up (at the next
    service ready) and the wait for a stop at once."""
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup, as CI runs
    with cli_stop.interrupts() as interrupted:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handler runs here
        except BaseException:  # noqa: BLE001 - what grpc's Channel.__del__ does
            pass
        assert interrupted.is_set()
        started = time.monotonic()
        cli_stop.wait_for_stop_signal(interrupted)
        assert time.monotonic() - started < 0.5
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_closed_terminal_stops_up_as_ctrl_c_does() -> None:
    """SIGHUP (the terminal `epd up` runs in closed) ends start-up and the wait like Ctrl-C, so the services are
    stopped rather than left on their ports; the handler that was there is back after."""
    before = signal.getsignal(signal.SIGHUP)
    with pytest.raises(KeyboardInterrupt), cli_stop.interrupts():
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(1.0)
    threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGHUP)).start()
    started = time.monotonic()
    cli_stop.wait_for_stop_signal()
    assert time.monotonic() - started < 5.0
    assert signal.getsignal(signal.SIGHUP) is before


def test_start_up_honours_a_ctrl_c_even_when_it_inherited_sigint_ignored() -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored (as CI's runner may start the
    suite): `epd up` installs its own handler, so `kill -INT` still ends start-up, as it ends the wait after it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), cli_stop.interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
    finally:
        signal.signal(signal.SIGINT, before)
