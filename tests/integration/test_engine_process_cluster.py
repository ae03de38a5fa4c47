"""`EPD_ENGINE_PROCESS=on` through the whole cluster: the worker's engine runs in a child process of its own. With no
encoder deployed, the router has the worker encode (the tower runs in the child too); greedy answers equal
`generate`, also where the engine answers from embeddings it kept from an earlier request; killing the engine process
ends the running stream with an error within seconds (no hang) and the worker exits with code 1, for its supervisor
to restart it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from services.client import Client, user_request
from services.launch.local import LocalCluster
from tests import media_factory
from tests.integration.conftest import RedisServer, module_cluster
from tests.integration.test_skeleton import MAX_TOKENS, PROMPT, expected


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    env = {"EPD_ENGINE_PROCESS": "on", "EPD_HTTP_PORT": "0"}
    yield from module_cluster(tiny_model_dir, redis_server, tmp_path_factory, encoders=0, env=env)


def engine_child(parent: int) -> int:
    """The pid of the engine process the worker ``parent`` started (named `epd-engine`, forked or spawned)."""
    for child in psutil.Process(parent).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.name() == "epd-engine":
                return child.pid
    raise AssertionError(f"worker {parent} has no engine process")


def test_answers_equal_generate_with_the_tower_in_the_engine_process(
    cluster: LocalCluster, tiny_model_dir: Path
) -> None:
    client = Client(cluster.address)
    try:
        for images, prompt in [
            ([media_factory.jpeg(1400, 1100, seed=1)], PROMPT),
            ([media_factory.png(64, 96, seed=5), media_factory.jpeg(150, 80, seed=6)], "Compare them."),
            # the same two swapped: neither is under a cached prefix, and the engine holds both embeddings from the
            # request before (the worker sends neither again)
            ([media_factory.jpeg(150, 80, seed=6), media_factory.png(64, 96, seed=5)], "Compare them."),
            ([], "Hello there"),
        ]:
            answer = client.generate(user_request(prompt, images, max_tokens=MAX_TOKENS))
            assert answer.token_ids == expected(tiny_model_dir, images, prompt), prompt
    finally:
        client.close()


def test_a_constrained_request_is_compiled_and_masked_in_the_engine_process(cluster: LocalCluster) -> None:
    """The constraint crosses the pipe with the request; the child's engine compiles it and masks its steps."""
    client = Client(cluster.address)
    try:
        request = user_request("Is it raining?", max_tokens=16)
        request.sampling.choice.choices.extend(["yes, it is", "no, it is not"])
        answer = client.generate(request)
        assert answer.text in ("yes, it is", "no, it is not") and answer.final.finish_reason == "stop"
    finally:
        client.close()


def test_the_worker_exits_when_its_engine_process_dies(cluster: LocalCluster) -> None:
    worker = cluster.workers[0].popen
    child = engine_child(worker.pid)
    client = Client(cluster.address)
    try:
        request = user_request("Count for a long time.", max_tokens=4000)
        request.sampling.ignore_eos = True
        stream = client.stream(request)
        while not next(stream).HasField("chunk"):  # a first token: the request runs in the engine process
            pass
        os.kill(child, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in stream:
                pass
        # the worker's stream fails (INTERNAL); the router migrates the request, and with no other worker the
        # retry is refused (UNAVAILABLE), or waits for room the dead worker's last KV state does not show
        ended = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert failed.value.code() in ended, failed.value
        assert time.monotonic() - started < 30
        assert worker.wait(timeout=30) == 1
    finally:
        client.close()
