"""A Redis for a local cluster: whether one answers at a URL, and one started on its port when none does."""

from __future__ import annotations

import shutil
import subprocess
import time

import redis


def redis_answers(url: str) -> bool:
    """Whether a Redis at `url` answers a ping within half a second."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        ok = bool(client.ping())
        client.close()
        return ok
    except (redis.RedisError, OSError):
        return False


def ensure_redis(url: str) -> subprocess.Popen | None:
    """Return None when Redis at `url` answers; else start redis-server on its port and return it."""
    if redis_answers(url):
        return None
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError(f"no Redis answers at {url} and redis-server is not installed")
    port = redis.connection.parse_url(url).get("port", 6379)
    popen = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(50):
        if redis_answers(url):
            return popen
        time.sleep(0.1)
    popen.kill()
    raise RuntimeError(f"started redis-server but {url} does not answer")
