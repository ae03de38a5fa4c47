"""Tensor parallelism through the whole cluster (CPU, gloo, real processes): two workers of EPD_TENSOR_PARALLEL_SIZE=2
(each a rank-0 worker process and one rank process) publish their size, answer 16 concurrent mixed text/image
requests exactly as `generate`; kill -9 of a worker's rank under 16-way load: every request completes through
migration with the undisturbed run's tokens, and the worker and its rank are gone within 10 s; kill -9 of a
worker takes its rank with it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.client import Client, user_request
from services.launch.local import LocalCluster
from tests import media_factory
from tests.integration.conftest import RedisServer, module_cluster
from tests.integration.test_skeleton import MAX_TOKENS, expected
from tests.reliability_support import StreamsStarted, describe, image_request, run_all, settled_workers, text_request

STREAMS, TOKENS = 16, 96


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    env = {"EPD_TENSOR_PARALLEL_SIZE": "2", "EPD_HTTP_PORT": "0"}
    yield from module_cluster(tiny_model_dir, redis_server, tmp_path_factory, encoders=1, workers=2, env=env)


def ranks_of(worker: int) -> list[int]:
    """The pids of the rank processes worker ``worker`` spawned (not multiprocessing's resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == worker and "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(entry))
    return found


def gone(pid: int, within_s: float) -> bool:
    """The process ``pid`` no longer exists (a zombie counts as gone) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_tp_workers_publish_their_size_and_answer_as_generate(cluster: LocalCluster, tiny_model_dir: Path) -> None:
    states = settled_workers(cluster.redis_url, 2)
    assert [s["tensor_parallel_size"] for s in states] == [2, 2]
    assert all(len(ranks_of(w.popen.pid)) == 1 for w in cluster.workers)
    cases = []
    for i in range(STREAMS):
        images = [media_factory.png(40 + 8 * i, 64 - 2 * (i % 5), seed=300 + 10 * i + k) for k in range(i % 4)]
        cases.append((images, f"question {i}: what do you see?" if images else f"tell me about {i}"))
    client = Client(cluster.address)
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            requests = [user_request(prompt, images, max_tokens=MAX_TOKENS) for images, prompt in cases]
            answers = list(pool.map(client.generate, requests))
        for (images, prompt), answer in zip(cases, answers, strict=True):
            assert answer.token_ids == expected(tiny_model_dir, images, prompt), prompt
    finally:
        client.close()


def _requests(salt: str) -> list:
    return [image_request(i, TOKENS, salt=salt) if i % 2 else text_request(i, TOKENS, salt=salt) for i in range(16)]


def test_a_rank_killed_under_load_every_request_completes_unchanged(cluster: LocalCluster) -> None:
    settled_workers(cluster.redis_url, 2)
    calm = run_all([cluster.address], _requests("calm"))
    assert all(o.ok and len(o.token_ids) == TOKENS for o in calm), describe([o for o in calm if not o.ok])
    worker = cluster.workers[0].popen
    (rank,) = ranks_of(worker.pid)
    on_chunk = StreamsStarted(STREAMS)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, [cluster.address], _requests("disturbed"), 120.0, on_chunk)
        on_chunk.wait(120)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        assert worker.wait(timeout=10) == 1  # the worker exits with its rank lost
        assert time.monotonic() - killed < 10 and gone(rank, 1)
        disturbed = running.result()
    assert all(o.ok for o in disturbed), describe([o for o in disturbed if not o.ok])
    for quiet, moved in zip(calm, disturbed, strict=True):
        assert moved.token_ids == quiet.token_ids, f"request {moved.index} ({moved.migrations} migrations)"
    assert sum(o.migrations for o in disturbed) > 0


def test_a_worker_killed_takes_its_rank_with_it(cluster: LocalCluster) -> None:
    worker = cluster.workers[1].popen
    (rank,) = ranks_of(worker.pid)
    os.kill(worker.pid, signal.SIGKILL)
    assert gone(rank, 10)
