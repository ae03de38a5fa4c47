"""One `epd serve <role>` child process, owned by whoever creates it (a Ray actor in ray_launcher).

Invariant: a `ServiceProcess` runs at most one child, in its own session (process group); after
`stop()` returns, neither the child nor any process descended from it is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launch.ports import free_port

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class HealthReport:
    """Outcome of waiting for a service: SERVING, or why not (with the tail of its log)."""

    ok: bool
    detail: str


def epd_command() -> list[str]:
    """How to run the `epd` CLI with this interpreter's environment."""
    beside = Path(sys.executable).with_name("epd")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("epd")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from services.cli import main; sys.exit(main())"]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found.extend(kids)
        frontier.extend(kids)
    return found


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _die_with_parent() -> None:
    """In the child before exec: new session, and SIGTERM when the parent (the actor) dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServiceProcess:
    """Runs one service process and reports on it; see the module docstring for the invariant."""

    def __init__(self, name: str, log_dir: str) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        return free_port()

    def start(self, command: list[str] | None, role: str, env: dict[str, str]) -> int:
        """Run `<command or epd> serve <role>` with `env` over this process's environment; returns its pid."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [*(command or epd_command()), "serve", role],
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        return self._proc.pid

    def pids(self) -> list[int]:
        """The child and its descendants, while alive."""
        if self._proc is None or self._proc.poll() is not None:
            return []
        return [self._proc.pid, *descendants(self._proc.pid)]

    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    def wait_healthy(self, address: str, timeout_s: float) -> HealthReport:
        """Poll grpc.health.v1 on `address` until SERVING, the child exits, or the deadline."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                code = self.returncode()
                if code is not None:
                    return HealthReport(False, f"{self.name} exited with {code}:\n{self.log_tail()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return HealthReport(True, f"{self.name} serving on {address}")
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as exc:
                    last = f"{exc.code().name}"
                time.sleep(0.25)
        return HealthReport(
            False, f"{self.name} not serving on {address} after {timeout_s:.0f}s ({last}):\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        """SIGTERM the process group, SIGKILL what is left after `timeout_s`; returns the pids."""
        if self._proc is None:
            return []
        targets = self.pids()
        pgid = self._proc.pid
        _signal_all(pgid, targets, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while any(is_alive(p) for p in targets[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_all(pgid, [p for p in targets if is_alive(p)], signal.SIGKILL)
        self._proc.wait()
        while any(is_alive(p) for p in targets) and time.monotonic() < deadline + 5.0:
            time.sleep(0.05)
        return targets


def _signal_all(pgid: int, pids: list[int], sig: signal.Signals) -> None:
    """Signal the process group and each listed pid (descendants that left the group too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
