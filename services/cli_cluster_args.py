"""The flags `epd up` and `epd demo` share: model, process counts (a prefill pool too), device, start-up timeout,
ports, Ray."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services.launch import local
from services.launch.preflight import DEVICES


def add_cluster_arguments(cmd: argparse.ArgumentParser, *, ray: bool) -> None:
    """The flags `up` and `demo` share (with `ray`, also `--ray` and `--address`)."""
    cmd.add_argument("--model", metavar="DIR", help="model folder (default: a tiny random Qwen2-VL built offline)")
    cmd.add_argument(
        "--encoders",
        type=_int_in(0, 64, "a whole number from 0 to 64"),
        default=1,
        help="encoder processes (default 1; 0: each worker runs the vision tower itself, co-located)",
    )
    cmd.add_argument(
        "--workers", type=_int_in(1, 64, "a whole number from 1 to 64"), default=1, help="worker processes (default 1)"
    )
    cmd.add_argument(
        "--prefill-workers",
        type=_int_in(0, 64, "a whole number from 0 to 64"),
        default=0,
        help="prefill worker processes (default 0); with any, the workers decode and long prompts prefill there",
    )
    cmd.add_argument(
        "--pd-min-prefill-tokens",
        type=_int_in(1, 1 << 20, "a whole number from 1"),
        default=local.ClusterSpec.pd_min_prefill_tokens,
        metavar="TOKENS",
        help="with prefill workers: uncached prompt tokens from which a request prefills on one "
        f"(default {local.ClusterSpec.pd_min_prefill_tokens})",
    )
    cmd.add_argument(
        "--tensor-parallel-size",
        type=_int_in(1, 8, "a whole number from 1 to 8"),
        default=1,
        help="devices each worker's language model is sharded over, one rank process each (default 1)",
    )
    cmd.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="where encoders and workers compute (default: EPD_DEVICE, else cpu)",
    )
    cmd.add_argument(
        "--startup-timeout",
        type=_seconds,
        default=180.0,
        metavar="SECONDS",
        help="longest wait for every service to become healthy (default 180)",
    )
    _add_port(cmd, "--port", local.ROUTER_PORT, "the router's gRPC port")
    _add_port(cmd, "--http-port", local.HTTP_PORT, "the router's OpenAI-compatible HTTP port; 0 turns it off")
    _add_port(cmd, "--encoder-port", local.ENCODER_PORT, "first encoder's gRPC port; the next encoders count up")
    _add_port(cmd, "--worker-port", local.WORKER_PORT, "first worker's gRPC port; the next workers count up")
    _add_port(
        cmd,
        "--metrics-port",
        local.METRICS_PORT,
        "first Prometheus port: encoders, workers, then the router count up from it; 0 turns metrics off",
    )
    if ray:
        cmd.add_argument("--ray", action="store_true", help="run the services as Ray actors")
        cmd.add_argument("--address", help="Ray cluster address (default: start a local one)")


def _add_port(cmd: argparse.ArgumentParser, flag: str, default: int, text: str) -> None:
    lowest = 0 if flag in ("--http-port", "--metrics-port") else 1
    cmd.add_argument(
        flag,
        type=_int_in(lowest, 65535, f"a port from {lowest} to 65535"),
        default=default,
        metavar="PORT",
        help=f"{text} (default {default})",
    )


def _int_in(lowest: int, highest: int, wanted: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}") from None
        if not lowest <= value <= highest:
            raise argparse.ArgumentTypeError(f"{text} is not {wanted}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return value
