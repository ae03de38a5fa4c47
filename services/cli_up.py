"""`epd up` and `epd demo` on this box: check, start, report each service as it becomes ready, clean up on exit.

Every check (device, model folder, every port, Redis) runs before anything starts and raises a one-line
`UserError`. A service that dies or is not healthy in time during start-up is reported in one line naming its
log; the temporary log folder is kept then, and removed on every other exit, Ctrl-C and SIGTERM included.
Once up, `epd up` supervises: a service that exits is started again after a back-off, in one line each
(services/launch/supervisor.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from services.cli_errors import UserError, failure, one_line, usage_error
from services.cli_stop import interrupts, signals_ignored, wait_for_stop_signal
from services.launch import local
from services.launch.preflight import (
    check_device,
    check_model,
    check_ports,
    check_redis,
    check_tensor_parallel,
    resolve_device,
)
from services.launch.supervisor import Supervisor

DEFAULT_TINY = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "epd" / "tiny-qwen2-vl"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
PORT_FLAGS = {
    "router": "--port",
    "http": "--http-port",
    "encoder": "--encoder-port",
    "worker": "--worker-port",
    "metrics": "--metrics-port",
}
PORT_NAMES = {
    "router": "router gRPC",
    "http": "router OpenAI HTTP",
    "encoder": "encoder gRPC",
    "worker": "worker gRPC",
    "metrics": "metrics",
}


def up(args: argparse.Namespace) -> int:
    """`epd up`: start, report, wait for Ctrl-C (or SIGTERM), stop; `kill -USR1` prints its threads' stacks."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.ray:
        if args.prefill_workers:
            raise usage_error("--prefill-workers is not built for --ray", "drop --ray to run a prefill pool locally")
        return _up_ray(args)
    with interrupts() as interrupted, running_cluster(args, interrupted) as cluster:
        print(f'router (gRPC Generate) at {cluster.address}. Try: epd generate --image FILE "describe"')
        print("A service that exits is restarted. Ctrl-C stops everything.", flush=True)
        with Supervisor(cluster.processes, report=lambda line: print(line, flush=True)):
            wait_for_stop_signal(interrupted)
    return 0


def demo(args: argparse.Namespace) -> int:
    """`epd demo`: start, send one image request and print the answer, stop."""
    from services.cli_request import print_answer, rpc_errors
    from services.client import Client, user_request

    with interrupts() as interrupted, running_cluster(args, interrupted) as cluster:
        print(f'request: one 448x336 PNG + "Describe this image." to {cluster.address}')
        request = user_request("Describe this image.", [demo_image()], max_tokens=args.max_tokens)
        with Client(cluster.address) as client, rpc_errors(cluster.address, 120.0):
            return print_answer(client, request, timeout_s=120.0)


@contextlib.contextmanager
def running_cluster(args: argparse.Namespace, interrupted: threading.Event) -> Iterator[local.LocalCluster]:
    """Check, start (logs in a temporary folder), yield the healthy cluster; stop it and remove the logs after.
    ``interrupted`` (``interrupts``) set ends start-up at the next service that becomes ready."""
    spec = checked_spec(args)
    with _log_folder() as log_dir:
        spec = dataclasses.replace(spec, log_dir=log_dir)
        pool = (
            f", {spec.prefill_workers} prefill worker(s) for prompts of {spec.pd_min_prefill_tokens}+ uncached tokens"
            if spec.prefill_workers
            else ""
        )
        workers = f"{spec.workers} {'decode ' if spec.prefill_workers else ''}worker(s){pool}"
        encoders = f"{spec.encoders} encoder(s)" if spec.encoders else "no encoder (the workers encode images)"
        print(
            f"starting router, {encoders}, {workers} for {spec.model_dir}; logs in {log_dir} (removed when epd exits)",
            flush=True,
        )
        cluster = _start(spec, args.startup_timeout, interrupted)
        try:
            yield cluster
        finally:
            with signals_ignored():
                cluster.stop()
            print("cluster stopped.", flush=True)


def checked_spec(args: argparse.Namespace) -> local.ClusterSpec:
    """The cluster the flags describe, after every check passed (builds the tiny model when --model is omitted)."""
    device = resolve_device(args.device)
    check_device(device)
    if args.model:
        check_model(Path(args.model))
    spec = spec_from_args(args, device)
    check_ports(port_rows(local.plan_ports(spec)))
    check_redis(spec.redis_url)
    if not args.model:
        tiny_model(DEFAULT_TINY)
    check_tensor_parallel(spec.model_dir, getattr(args, "tensor_parallel_size", 1), device)
    return spec


def spec_from_args(args: argparse.Namespace, device: str) -> local.ClusterSpec:
    """The cluster the flags describe on `device` (no check run); a UserError for flags that do not go together."""
    spec = local.ClusterSpec(
        Path(args.model) if args.model else DEFAULT_TINY,
        args.encoders,
        args.workers,
        os.environ.get("EPD_REDIS_URL", DEFAULT_REDIS),
        env={"EPD_DEVICE": device, **worker_settings(args)},
        router_port=args.port,
        http_port=args.http_port,
        encoder_port=args.encoder_port,
        worker_port=args.worker_port,
        metrics_port=args.metrics_port,
        prefill_workers=getattr(args, "prefill_workers", 0),
        pd_min_prefill_tokens=getattr(args, "pd_min_prefill_tokens", local.ClusterSpec.pd_min_prefill_tokens),
    )
    if spec.prefill_workers and getattr(args, "tensor_parallel_size", 1) > 1:
        raise usage_error(
            "--prefill-workers with --tensor-parallel-size above 1: a KV transfer would be per rank",
            "drop one of the two",
        )
    return spec


def worker_settings(args: argparse.Namespace) -> dict[str, str]:
    """The workers' settings the flags give (only what differs from the default)."""
    size = getattr(args, "tensor_parallel_size", 1)
    return {"EPD_TENSOR_PARALLEL_SIZE": str(size)} if size > 1 else {}


def port_rows(plan: local.PortPlan) -> list[tuple[str, int, str]]:
    """`(what, port, flag)` for every port the cluster will bind."""
    return [(PORT_NAMES[kind], port, PORT_FLAGS[kind]) for kind, port in plan.listening()]


def tiny_model(path: Path, family: str = "qwen2-vl") -> Path:
    """The tiny random model at `path`, built there first when missing (kept as a cache for the next run)."""
    from services.models.tiny_model import make_tiny_model

    if not (path / "config.json").exists():
        print(f"building a tiny random {family} model in {path} ...", flush=True)
        make_tiny_model(path, family)
    return path


def _start(spec: local.ClusterSpec, timeout_s: float, interrupted: threading.Event) -> local.LocalCluster:
    plan_http = local.plan_ports(spec).http

    def on_ready(process: local.Process) -> None:
        if interrupted.is_set():  # a Ctrl-C whose KeyboardInterrupt was dropped on the way (see cli_stop.interrupts)
            raise KeyboardInterrupt
        print(ready_line(process, plan_http), flush=True)

    try:
        return local.start_cluster(spec, timeout_s, on_ready=on_ready)
    except local.ClusterStartError as exc:
        raise _start_failure(exc) from None
    except RuntimeError as exc:  # ensure_redis: redis-server started but silent
        raise failure(one_line(exc), "start Redis yourself, or set EPD_REDIS_URL to one that answers") from None


def ready_line(process: local.Process, http_port: int) -> str:
    """One line for a service that became healthy: role, address(es), metrics, log."""
    where = process.address
    if process.role == "router":
        http = f"OpenAI HTTP at http://127.0.0.1:{http_port}/v1" if http_port else "OpenAI HTTP off"
        where = f"gRPC Generate at {process.address}, {http}"
    metrics = f"metrics http://127.0.0.1:{process.metrics_port}/metrics" if process.metrics_port else "metrics off"
    role = process.env.get("EPD_WORKER_ROLE", process.role) if process.role == "worker" else process.role
    return f"  ready: {role:8s} {where}  {metrics}  log {process.log_path}"


class StartFailed(UserError):
    """A service died or was not ready in time; its log folder is kept for the user to read."""


def _start_failure(exc: local.ClusterStartError) -> UserError:
    process = exc.process
    last = one_line(log_verdict(process.log_tail(20)), 200)
    fix = "pass a larger --startup-timeout, or fix" if "within" in exc.reason else "fix"
    return StartFailed(
        f"the {process.role} at {process.address} {exc.reason}; its log {process.log_path} ends: {last} "
        f"({fix} what the log says; the log folder is kept)"
    )


def log_verdict(tail: str) -> str:
    """The line of a service's log that says why it ended: its own last `epd: error:` line where it wrote one,
    else its last non-blank line, "(empty)" for none. Not merely the last line: a helper process that shares the
    log (multiprocessing's resource tracker warning of what the service left at exit) may write after the
    service exited, so what is last when `epd up` reads depends on timing."""
    lines = [line for line in tail.splitlines() if line.strip()]
    verdicts = [line for line in lines if line.startswith("epd: error: ")]
    return (verdicts or lines or ["(empty)"])[-1]


@contextlib.contextmanager
def _log_folder() -> Iterator[Path]:
    """A temporary folder, removed afterwards unless start-up failed or an unexpected error happened (the logs
    say why); such an error gets a note naming the folder."""
    path = Path(tempfile.mkdtemp(prefix="epd-up-"))
    keep = False
    try:
        yield path
    except StartFailed:
        keep = True
        raise
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        keep = True
        exc.add_note(f"service logs kept in {path}")
        raise
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def _up_ray(args: argparse.Namespace) -> int:
    try:
        from services.launch.ray_launcher import RayLaunchError, launch_on_ray
    except ImportError:
        raise failure("Ray is not installed", "pip install 'epd[ray]', or drop --ray") from None
    device = resolve_device(args.device)
    if args.address is None:  # a local Ray: this box's GPU, folder and ports
        check_device(device)
        if args.model:
            check_model(Path(args.model))
        check_ports(port_rows(local.plan_ports(_ray_port_spec(args))))
    model = Path(args.model) if args.model else tiny_model(DEFAULT_TINY)
    try:
        handle = launch_on_ray(
            model_dir=model,
            encoders=args.encoders,
            workers=args.workers,
            address=args.address,
            router_port=args.port,
            encoder_port=args.encoder_port,
            worker_port=args.worker_port,
            metrics_port=args.metrics_port,
            http_port=args.http_port,
            ready_timeout_s=args.startup_timeout,
            env={"EPD_DEVICE": device, **worker_settings(args)},
            gpus_per_worker=float(getattr(args, "tensor_parallel_size", 1)),  # one GPU per rank
        )
    except RayLaunchError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise failure(f"the cluster did not start on Ray: {first}", "fix what the message says") from None
    print(f"epd on Ray: {handle}")
    print("Ctrl-C stops everything.", flush=True)
    try:
        wait_for_stop_signal()
    finally:
        with signals_ignored():
            handle.stop()
    return 0


def _ray_port_spec(args: argparse.Namespace) -> local.ClusterSpec:
    return local.ClusterSpec(
        Path("."),
        args.encoders,
        args.workers,
        router_port=args.port,
        http_port=args.http_port,
        encoder_port=args.encoder_port,
        worker_port=args.worker_port,
        metrics_port=args.metrics_port,
    )


def demo_image() -> bytes:
    """A 448x336 PNG with a yellow disc and a red box on blue."""
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (448, 336), (30, 90, 160))
    draw = ImageDraw.Draw(image)
    draw.ellipse((60, 40, 260, 240), fill=(240, 200, 40))
    draw.rectangle((280, 120, 420, 300), fill=(200, 40, 60))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
