"""Checks `epd up` runs before starting anything: device, model folder, free ports, Redis.

Each check raises `UserError` with one line naming the problem and its fix: exit 2 when a flag's value
can never work here (no such model folder, `--device cuda` without a GPU), exit 1 when the box is in the
way (a port in use, no Redis). Nothing here starts a process or loads weights.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from services.cli_errors import failure, usage_error

DEVICES = ("cpu", "cuda")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def resolve_device(flag: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The device `--device` names, else EPD_DEVICE, else cpu; an EPD_DEVICE outside cpu/cuda is a usage error."""
    if flag is not None:
        return flag
    device = env.get("EPD_DEVICE", "cpu") or "cpu"
    if device not in DEVICES:
        raise usage_error(f"EPD_DEVICE={device} is not a device", "set it to cpu or cuda, or pass --device cpu|cuda")
    return device


def check_device(device: str) -> None:
    """`cuda` only when torch sees a GPU (imports torch only then)."""
    if device not in DEVICES:
        raise usage_error(f"--device {device} is not a device", "use --device cpu or --device cuda")
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise usage_error(
            f"--device cuda, but torch {torch.__version__} sees no CUDA GPU",
            "use --device cpu, or run where nvidia-smi lists a GPU with a CUDA build of torch",
        )


def check_model(model_dir: Path) -> str:
    """The folder's `model_type` when an adapter knows it; else a usage error naming what is missing."""
    from services.models.loading import read_model_type

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "is a file, not a folder" if model_dir.exists() else "does not exist"
        raise usage_error(f"model folder {model_dir} {what}", "pass --model DIR with a Hugging Face model folder")
    try:
        model_type = read_model_type(model_dir)
    except FileNotFoundError:
        raise usage_error(
            f"model folder {model_dir} has no config.json", "pass --model DIR with a complete Hugging Face model folder"
        ) from None
    except (ValueError, OSError) as exc:  # JSONDecodeError is a ValueError
        raise usage_error(
            f"{model_dir / 'config.json'} cannot be used: {exc}", "fix the file or download the model again"
        ) from None
    _check_adapter(model_dir, model_type)
    return model_type


def check_tensor_parallel(model_dir: Path, size: int, device: str) -> None:
    """A usage error when ``size`` cannot split the folder's model (its heads) or, on CUDA, exceeds the GPUs."""
    if size == 1:
        return
    from transformers import AutoConfig

    from services.worker.engine.tensor_parallel.plan import ShardPlan

    try:
        ShardPlan.of_config(AutoConfig.from_pretrained(model_dir, local_files_only=True), size)
    except ValueError as exc:
        raise usage_error(f"--tensor-parallel-size {size}: {exc}", "pass a size the model's heads divide by") from None
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < size:
            raise usage_error(
                f"--tensor-parallel-size {size} needs {size} GPUs per worker; torch sees {torch.cuda.device_count()}",
                "pass a smaller size",
            )


def _check_adapter(model_dir: Path, model_type: str) -> None:
    from services.models.registry import ADAPTERS

    if model_type not in ADAPTERS:
        raise usage_error(
            f"model folder {model_dir} holds a {model_type!r} model, which epd cannot serve",
            f"use a {' or '.join(sorted(ADAPTERS))} model",
        )


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server could not bind `host:port` now (SO_REUSEADDR, as servers set it: TIME_WAIT is free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(ports: Sequence[tuple[str, int, str]]) -> None:
    """Each `(what, port, flag)` with port > 0 must be free and listed once; the error names the flag to change."""
    seen: dict[int, str] = {}
    for what, port, flag in ports:
        if port <= 0:
            continue
        if port > 65535:
            raise usage_error(f"the {what} would get port {port}, beyond 65535", f"pass a lower {flag}")
        if port in seen:
            raise usage_error(
                f"port {port} is given to both the {seen[port]} and the {what}",
                f"give them different ports (see {flag})",
            )
        seen[port] = what
        if port_in_use(port):
            raise failure(
                f"port {port} ({what}) is already in use", f"stop what listens there, or pass {flag} with a free port"
            )


def check_redis(url: str) -> None:
    """Redis answers at `url`, or it is on this box and redis-server is installed to start it."""
    from services.launch.local_redis import redis_answers

    if redis_answers(url):
        return
    host = urlsplit(url).hostname or "127.0.0.1"
    if host not in LOOPBACK_HOSTS:
        raise failure(f"no Redis answers at {url}", "start it, or set EPD_REDIS_URL to a Redis that answers")
    if shutil.which("redis-server") is None:
        raise failure(
            f"no Redis answers at {url} and redis-server is not installed",
            "install Redis (apt-get install redis-server), or set EPD_REDIS_URL to a running one",
        )
