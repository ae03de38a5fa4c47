"""`epd up --ray` as a user runs it: a local Ray, one image request, then Ctrl-C leaves nothing running.

`epd up` uses the documented ports (gRPC 50051/50061/50071, metrics 9400-9402), so the test waits
for them to be free first and says which are taken if they never are.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from services.client import Client, user_request
from services.launch.health import check
from tests import media_factory
from tests.integration.conftest import RedisServer

ROUTER = "127.0.0.1:50051"
PORTS = (50051, 50061, 50071, 9400, 9401, 9402, 8000)
READY_LINE = "Ctrl-C stops everything."
SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_ports_free(ports: tuple[int, ...], timeout_s: float) -> list[int]:
    """The ports still answering after `timeout_s` (another `epd up` may be finishing)."""
    deadline = time.monotonic() + timeout_s
    while (taken := [p for p in ports if port_taken(p)]) and time.monotonic() < deadline:
        time.sleep(1.0)
    return taken


class Output:
    """Drains a child's stdout on a thread (so it never blocks on a full pipe) and keeps every line."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                return False
            if line is None:
                return False
            self.lines.append(line)
            if text in line:
                return True
        return False

    def text(self) -> str:
        while not self._queue.empty():
            line = self._queue.get_nowait()
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines)


def cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def still_running(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `processes` alive (not zombies) after waiting up to `timeout_s` for them to exit."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    left = []
    for process in alive:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except psutil.NoSuchProcess:
            continue
    return left


def ray_session(processes: list[psutil.Process]) -> str:
    """The Ray session name in the command line of the GCS server among `processes`."""
    for process in processes:
        text = cmdline(process)
        if "gcs_server" in text and (match := SESSION.search(text)):
            return match.group(0)
    raise AssertionError(
        "no Ray GCS server among the processes epd up started:\n" + "\n".join(cmdline(p)[:200] for p in processes)
    )


def kill_tree(pid: int) -> None:
    """Last resort after a failure: SIGKILL `pid` and everything below it."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue


def ask(image: bytes):
    client = Client(ROUTER)
    try:
        return client.generate(user_request("Describe the image.", [image], max_tokens=4), timeout_s=120)
    finally:
        client.close()


def test_up_ray_serves_an_image_request_and_ctrl_c_stops_everything(
    tiny_model_dir: Path, redis_server: RedisServer
) -> None:
    taken = wait_ports_free(PORTS, timeout_s=120)
    assert not taken, f"`epd up --ray` needs ports {PORTS}; still in use: {taken}"
    env = {**os.environ, "EPD_REDIS_URL": redis_server.url}
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--ray", "--model", str(tiny_model_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Output(up.stdout)
    try:
        assert output.wait_for(READY_LINE, timeout_s=300), "epd up --ray did not come up:\n" + output.text()
        assert f"router_addr='{ROUTER}'" in output.text(), output.text()
        assert check(ROUTER)
        started = psutil.Process(up.pid).children(recursive=True)
        session = ray_session(started)
        serving = [cmdline(p) for p in started if re.search(r"\bserve (router|encoder|worker)\b", cmdline(p))]
        assert len(serving) >= 3, serving
        answer = ask(media_factory.png(160, 120))
        assert answer.final is not None and answer.token_ids, output.text()
        assert answer.final.usage.image_tokens > 0
        assert answer.final.usage.completion_tokens == len(answer.token_ids)
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
    finally:
        if up.poll() is None:
            kill_tree(up.pid)
            up.wait(timeout=30)
    assert up.returncode == 0, output.text()
    left = still_running(started, timeout_s=30)
    assert left == [], f"left running: {[(p.pid, cmdline(p)[:120]) for p in left]}"
    ray_left = [p for p in psutil.process_iter() if session in cmdline(p)]
    assert ray_left == [], f"Ray session {session} still has processes: {ray_left}"
    assert not check(ROUTER, timeout_s=0.5)
    assert redis_server.client().ping()
