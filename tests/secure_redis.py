"""A private redis-server with AUTH and only a TLS port (certificates made here), for security tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.launch.local import free_port
from services.launch.local_redis import redis_answers
from tests.certs import CertAuthority

PASSWORD = "s3cret-Redis_pw"


@dataclass
class SecureRedis:
    """redis-server with `--requirepass` and `--tls-port` (no plaintext port), its CA's certificate."""

    port: int
    ca_file: Path
    process: subprocess.Popen

    def url(self, password: str = PASSWORD) -> str:
        return f"rediss://:{password}@127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"

    @classmethod
    @contextlib.contextmanager
    def running(cls, folder: Path) -> Iterator[SecureRedis]:
        """Start one in `folder` (its certificates go there), stop it when the block ends."""
        ca = CertAuthority.create(folder, "redis")
        pair = ca.issue(folder, "redis-server")
        port = free_port()
        server = shutil.which("redis-server")
        assert server, "redis-server is required"
        args = [server, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port), "--save", ""]
        args += ["--appendonly", "no", "--tls-cert-file", str(pair.cert_file), "--tls-key-file", str(pair.key_file)]
        args += ["--tls-ca-cert-file", str(ca.cert_file), "--tls-auth-clients", "no", "--requirepass", PASSWORD]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        secure = cls(port, ca.cert_file, process)
        try:
            for _ in range(100):
                if redis_answers(secure.url()):
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError("redis-server with TLS did not start (is it built with TLS?)")
            yield secure
        finally:
            process.terminate()
            process.wait(timeout=10)
