"""`epd serve <role>` processes forked from one process that has imported torch, transformers and the services.

A cold `python -m services.cli serve <role>` spends about 3 CPU-seconds importing before it loads a model
(torch, transformers' model and processor machinery, the role's modules); a cluster of three pays it three
times. `ForkServer` starts `python -m services.launch.forkserver` once, which does those imports and then forks
one child per `spawn`: the child pays only its own start (model, tokenizer, warm-up).
`local.set_start_method("forkserver")` makes `local.spawn` use one (the test suite does); `epd up` execs each
service.

Invariants: a child runs what `python -m services.cli serve <role>` runs (`services.cli.main`), in its own
process group, with exactly the environment, working directory and log (stdout and stderr, appended) it was
asked for, torch's generator as a fresh process has it and a multiprocessing authkey of its own. The
preloaded modules read the environment the server started with, so a spawn whose environment differs from
it in a variable other than those read only at run time (`EPD_*`, `OTEL_*`) is not forked (`spawn` returns
None; the caller execs). A `ForkedProcess` answers like a `subprocess.Popen` of that command (`poll`, `wait`,
signals; `returncode` minus the signal's number when killed); the server reaps it and reports its exit. The
server exits when its launcher closes the connection or dies; its children then get SIGKILL.

The server forks with no thread of its own running (numpy's OpenBLAS keeps one, which is fork-safe) and runs
no torch op before forking, so each child starts torch's thread pools itself.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import multiprocessing
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUNTIME_PREFIXES = ("EPD_", "OTEL_")
"""Variables the preloaded modules never read at import: a spawn may set them to anything."""

START_TIMEOUT_S = 300.0  # the server's imports, on a busy box
_PR_SET_PDEATHSIG = 1


class ForkedProcess:
    """A service forked by a `ForkServer`, with the part of `subprocess.Popen`'s interface launchers use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args  # the command it stands for: `python -m services.cli ...`
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.exited:
            if not self._server.exited.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: starts the server, asks it for children, and records their exits."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.owner = os.getpid()
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "services.launch.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
            process_group=0,
        )
        theirs.close()
        self._sock = ours
        self._lines = ours.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()  # one request at a time: a reply follows its request
        self.exited = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits reported before the spawn's reply was read
        self._reply: dict[str, Any] | None = None
        self._gone = False  # the server closed the connection (exited)
        ours.settimeout(START_TIMEOUT_S)
        try:
            first = self._read()
        except TimeoutError:
            first = {"error": f"not ready within {START_TIMEOUT_S:g}s"}
        ours.settimeout(None)
        if first is None or "error" in first:
            self._process.kill()
            self._process.wait()
            reason = "it exited" if first is None else first["error"]
            raise RuntimeError(f"the fork server did not start: {reason}")
        self._reader = threading.Thread(target=self._read_events, name="epd-forkserver", daemon=True)
        self._reader.start()

    def compatible(self, env: Mapping[str, str]) -> bool:
        """True when `env` agrees with the server's own environment outside the run-time variables."""
        names = {name for name in {*env, *self.env} if not name.startswith(RUNTIME_PREFIXES)}
        return all(env.get(name) == self.env.get(name) for name in names)

    def spawn(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> ForkedProcess | None:
        """Fork `services.cli.main(argv)` with `env` (the whole environment), logging to `log_path`; None when
        `env` is not `compatible` with the server's (exec the command instead)."""
        if not self.compatible(env):
            return None
        request = {"argv": argv, "env": dict(env), "cwd": os.getcwd(), "log": str(log_path)}
        with self._lock:
            with self.exited:
                self._reply = None
            self._sock.sendall((json.dumps(request) + "\n").encode())
            with self.exited:
                self.exited.wait_for(lambda: self._reply is not None or self._gone)
                reply, self._reply = self._reply, None
                if reply is None or "error" in reply:
                    raise RuntimeError(f"the fork server could not start {argv}: {reply and reply['error']}")
                child = ForkedProcess(self, int(reply["pid"]), [sys.executable, "-m", "services.cli", *argv])
                self._children[child.pid] = child
                if child.pid in self._early_exits:
                    child.returncode = self._early_exits.pop(child.pid)
        return child

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the connection (the server exits; children still running get SIGKILL) and wait for it."""
        if os.getpid() != self.owner:  # a forked copy of the launcher: the server is not ours to close
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout_s)
        self._lines.close()
        self._sock.close()

    def _read(self) -> dict[str, Any] | None:
        line = self._lines.readline()
        return json.loads(line) if line else None

    def _read_events(self) -> None:
        while (event := self._read()) is not None:
            with self.exited:
                if "exit" in event:
                    pid, code = int(event["exit"]), int(event["code"])
                    if pid in self._children:
                        self._children.pop(pid).returncode = code
                    else:
                        self._early_exits[pid] = code
                else:
                    self._reply = event
                self.exited.notify_all()
        with self.exited:  # the server is gone, and with it (PDEATHSIG) every child it had
            self._gone = True
            for child in self._children.values():
                child.returncode = -signal.SIGKILL
            self._children.clear()
            self.exited.notify_all()


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared(env: Mapping[str, str]) -> ForkServer:
    """This process's fork server, started on first use with `env` and closed at exit (a new one after
    `os.fork`); later calls return it whatever their `env`."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.owner != os.getpid():
            _shared = ForkServer(env)
            atexit.register(_shared.close)
        return _shared


def _preload() -> None:
    """What `epd serve` imports for every role (after `services.cli.main`'s own setting)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import services.cli
    import services.encoder.server
    import services.router.startup
    import services.serve
    import services.worker.startup

    # transformers' lazy names: the model, processor and tokenizer machinery each service loads a folder with
    for name in ("AutoConfig", "AutoImageProcessor", "AutoModelForImageTextToText", "AutoTokenizer"):
        getattr(transformers, name)
    del services


def _serve(sock: socket.socket) -> dict[str, Any]:
    """The server's loop: fork a child per request, report each child's exit; returns only in a child,
    with its request. Exits (the process) when the launcher closes the connection."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    buffered = b""

    def send(event: dict[str, Any]) -> None:
        sock.sendall((json.dumps(event) + "\n").encode())

    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data = sock.recv(65536)
            if not data:
                sys.exit(0)
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:  # EAGAIN, ENOMEM: the launcher raises it
                    send({"error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    request["server"] = os.getppid()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    sock.close()
                    return request
                send({"pid": pid})


def _become(request: dict[str, Any]) -> int:
    """In a forked child: take the requested process group, directory, environment and log, then serve."""
    import torch

    import services.cli

    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != request["server"]:  # the server died before the line above could tie us to it
        return 1
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.argv = [services.cli.__file__, *request["argv"]]
    # what a fresh process has: torch's generator as seeded (no import above drew from it), its own authkey
    torch.manual_seed(torch.initial_seed())
    multiprocessing.current_process().authkey = os.urandom(32)
    return services.cli.main(request["argv"])


def main(fd: int) -> None:
    """`python -m services.launch.forkserver FD`: preload, say ready on the socket FD, then serve it."""
    sock = socket.socket(fileno=fd)
    try:
        _preload()
    except BaseException as exc:  # reported to the launcher, which raises it
        sock.sendall((json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
        raise
    sock.sendall(b'{"ready": true}\n')
    request = _serve(sock)
    sys.exit(_become(request))


if __name__ == "__main__":
    main(int(sys.argv[1]))
