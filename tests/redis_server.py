"""A private redis-server for a test module: its own port, nothing on disk, stopped with the module."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

import redis


@dataclass
class RedisServer:
    """A real redis-server of the test's own, so stopping it disturbs nobody else."""

    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server, "redis-server is required for integration tests"
        self.process = subprocess.Popen(
            [server, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)
