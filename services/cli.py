"""The `epd` command: serve, up, demo, generate, count, health, make-tiny-model, bench, profile, plan.

A user error prints one line, `epd: error: <problem> (<fix>)`, on stderr and exits 2 when the command line
is wrong or 1 when something failed; an unexpected error prints one line too, or its traceback with
`--debug` (or EPD_DEBUG=1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from services import cli_cluster_args, cli_plan, cli_request, cli_up
from services.cli_errors import USAGE, UserError, one_line
from services.common import config as config_lib


def _serve(args: argparse.Namespace) -> int:
    from services.common.service_main import run_until_signalled, setup_logging
    from services.common.tracing import setup_tracing, shutdown_tracing
    from services.launch.preflight import check_model
    from services.serve import CONFIGS, start_role

    try:
        config = config_lib.load(CONFIGS[args.role], args)
    except config_lib.ConfigError as exc:
        raise UserError(f"{exc} (see `epd serve {args.role} --help`)", USAGE) from None
    check_model(Path(config.model))
    try:
        setup_logging(config.log_level, args.role, config.log_format)
        tracing = setup_tracing(args.role)
    except ValueError as exc:
        raise UserError(str(exc), USAGE) from None
    if config.torch_threads > 0 and config.computes_here():
        import torch

        torch.set_num_threads(config.torch_threads)
    try:
        asyncio.run(run_until_signalled(lambda: start_role(args.role, config), config.launcher_pid))
    finally:
        shutdown_tracing(tracing)
    return 0


def _health(args: argparse.Namespace) -> int:
    from services.common.tls import client_from_env
    from services.launch.health import check

    ok = check(args.address, args.service, tls=client_from_env(os.environ))
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


def _make_tiny(args: argparse.Namespace) -> int:
    from services.models.tiny_model import make_tiny_model

    try:
        path = make_tiny_model(Path(args.dir), args.family, max_pixels=args.max_pixels)
    except ValueError as exc:  # a size the family refuses (max_pixels below the minimum, or given for llava)
        raise UserError(f"{exc} (see `epd make-tiny-model --help`)", USAGE) from None
    print(path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Benchmarks live in the source checkout (tests/bench/); run one there as a module."""
    root = Path(__file__).resolve().parent.parent
    name = args.what.replace("-", "_")  # `kv-transfer` is tests/bench/bench_kv_transfer.py
    if not (root / "tests" / "bench" / f"bench_{name}.py").exists():
        raise UserError(
            f"epd bench needs a source checkout: no tests/bench/ next to services/ under {root} "
            "(run it from a clone of the repository)",
            USAGE,
        )
    return _wait_forwarding(subprocess.Popen([sys.executable, "-m", f"tests.bench.bench_{name}", *args.rest], cwd=root))


def _wait_forwarding(child: subprocess.Popen) -> int:
    """Wait for a bench to end; SIGTERM or SIGHUP here reaches it as SIGINT, after which it stops its clusters as
    after Ctrl-C. A Ctrl-C from a terminal reaches it too (one process group), and this process waits for its
    cleanup: `subprocess.call` SIGKILLed it then, and a `timeout` or `kill` killed only this process; either way
    the bench's services outlived it."""

    def forward(signum: int, frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    interrupted = False
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                interrupted = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupted:
        raise KeyboardInterrupt
    return 128 - code if code < 0 else code  # ended by a signal: the shell's convention (130 for SIGINT)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"epd: error: {one_line(message)} (see `{self.prog} --help`)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"epd {version('epd')}"
    except PackageNotFoundError:
        return "epd (version unknown: not installed; pip install -e .)"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="epd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    up = sub.add_parser("up", help="start the whole cluster on this box (Ctrl-C stops it)")
    cli_cluster_args.add_cluster_arguments(up, ray=True)
    up.set_defaults(fn=cli_up.up)
    demo = sub.add_parser("demo", help="start the cluster, send one image request, stop")
    cli_cluster_args.add_cluster_arguments(demo, ray=False)
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    demo.set_defaults(fn=cli_up.demo)
    generate = sub.add_parser("generate", help="send one request to the router and print the answer as it streams")
    cli_request.add_request_arguments(generate, sampling=True, timeout_s=120.0)
    generate.set_defaults(fn=cli_request.generate)
    count = sub.add_parser("count", help="count a request's text, image and projected tokens (nothing generated)")
    cli_request.add_request_arguments(count, sampling=False, timeout_s=30.0)
    count.set_defaults(fn=cli_request.count)
    _add_tools(sub)
    cli_plan.add_commands(sub)
    for cmd in sub.choices.values():
        _add_debug(cmd, argparse.SUPPRESS)
    return parser


def _add_debug(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="print the traceback of an unexpected error (also: EPD_DEBUG=1)",
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from services.serve import CONFIGS

    serve = sub.add_parser("serve", help="run one service in the foreground (flags or EPD_* variables)")
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, cls in CONFIGS.items():
        config_lib.add_arguments(roles.add_parser(role, help=f"the {role}"), cls)
    serve.set_defaults(fn=_serve)


def _add_tools(sub: argparse._SubParsersAction) -> None:
    from services.models.tiny_model import TINY_FAMILIES  # no torch: the parser stays quick

    health = sub.add_parser("health", help="exit 0 when a service reports SERVING")
    health.add_argument("address", metavar="HOST:PORT", help="the service's gRPC address")
    health.add_argument("--service", default="", help="the health service name to ask about (default: the server)")
    health.set_defaults(fn=_health)
    tiny = sub.add_parser("make-tiny-model", help="build a tiny random model folder offline")
    tiny.add_argument("dir", help="folder to write the model into")
    tiny.add_argument("--family", default="qwen2-vl", choices=TINY_FAMILIES, help="model family")
    tiny.add_argument("--max-pixels", type=int, default=None, help="image processor's max_pixels (default: its own)")
    tiny.set_defaults(fn=_make_tiny)
    bench = sub.add_parser("bench", help="benchmarks (print ratios against a same-run baseline)")
    benches = ["engine", "encoder", "admission", "burst", "traffic", "soak", "serve", "vllm", "hostile", "grammar_step",
               "kv-transfer"]  # fmt: skip
    bench.add_argument("what", choices=benches, help="what to measure")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="flags passed on to the benchmark")
    bench.set_defaults(fn=_bench)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub at run time
    sys.stdout.reconfigure(line_buffering=True)  # lines reach a file or pipe as they are printed
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("EPD_DEBUG", "").strip().lower() in config_lib.TRUE_WORDS
    try:
        return args.fn(args)
    except UserError as exc:
        return _fail(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:
        if debug or args.command == "serve":  # a service's output is its log: keep the whole story there
            traceback.print_exc()
        if debug:
            return 1
        return _fail(_unexpected(exc, args.command), 1)


def _unexpected(exc: Exception, command: str) -> str:
    notes = "; ".join(getattr(exc, "__notes__", []))
    where = f"; {notes}" if notes else ""
    hint = "the traceback is above" if command == "serve" else "run again with --debug or EPD_DEBUG=1 for the traceback"
    return f"`epd {command}` failed unexpectedly: {type(exc).__name__}: {one_line(exc, 200)}{where} ({hint})"


def _fail(message: str, code: int) -> int:
    print(f"epd: error: {one_line(message, 600)}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
