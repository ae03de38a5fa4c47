"""Prefill/decode disaggregation between two real worker processes (their own Redis, no router): a decode worker
(`EPD_WORKER_ROLE=decode`) admits requests to receive their KV, a prefill worker (`prefill`, chunked prefill)
prefills them and pushes every chunk's blocks over `Worker.PushKV`; the decode worker's tokens equal transformers'
`generate`, a repeated prompt ships only what the decode worker's prefix cache lacks, and a cancel while the KV is
in flight frees every block on both."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.common.model_info import load_model_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.launch import local
from services.launch.health import wait_healthy
from services.models.base import ChatMessage, ChatPart
from tests.integration.conftest import RedisServer, metric_value, model_folder
from tests.oracle import hf_generate

DEADLINE_S = 15.0  # the decode worker's EPD_KV_TRANSFER_TIMEOUT_S
LONG = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm window "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "tiny-pd")


@pytest.fixture(scope="module")
def workers(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, local.Process]]:
    logs = tmp_path_factory.mktemp("logs")
    base = {"EPD_MODEL": str(model_dir), "EPD_REDIS_URL": redis_server.url, "EPD_TORCH_THREADS": "1"}
    roles = {"prefill": {"EPD_MAX_NUM_BATCHED_TOKENS": "32"}, "decode": {"EPD_KV_TRANSFER_TIMEOUT_S": str(DEADLINE_S)}}
    started = {
        role: local.spawn("worker", local.free_port(), local.free_port(), {**base, "EPD_WORKER_ROLE": r, **env}, logs)
        for role, env in roles.items()
        for r in [role]
    }
    try:
        for process in started.values():
            wait_healthy(process.address, 120, lambda p=process: p.popen.poll() is None)
        yield started
    finally:
        for process in started.values():
            process.popen.terminate()
        for process in started.values():
            process.popen.wait(timeout=20)


def _request(adapter, request_id: str, prompt: str, max_tokens: int, salt: str = "") -> worker_pb2.WorkerRequest:
    built = adapter.build_prompt([ChatMessage("user", [ChatPart("text", prompt)])], [])
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
    ids = built.token_ids
    return worker_pb2.WorkerRequest(request_id=request_id, token_ids=ids, sampling=sampling, cache_salt=salt)


def _split(workers: dict[str, local.Process], request: worker_pb2.WorkerRequest) -> tuple[list[int], str, int]:
    """Admit at the decode worker, prefill at the prefill worker (pushing to the decode worker), read the tokens:
    (tokens, finish reason, blocks the decode worker already held)."""
    decode_address, prefill_address = workers["decode"].address, workers["prefill"].address
    with grpc.insecure_channel(decode_address) as d, grpc.insecure_channel(prefill_address) as p:
        receive = worker_pb2.WorkerRequest()
        receive.CopyFrom(request)
        receive.kv_transfer.direction = "receive"
        stream = worker_pb2_grpc.WorkerStub(d).Generate(receive, timeout=120)
        admitted = next(stream)
        assert admitted.admitted
        send = worker_pb2.WorkerRequest()
        send.CopyFrom(request)
        send.kv_transfer.direction, send.kv_transfer.peer = "send", decode_address
        send.kv_transfer.skip_blocks = admitted.kv_skip_blocks
        prefilled = list(worker_pb2_grpc.WorkerStub(p).Generate(send, timeout=120))
        assert prefilled[0].admitted and prefilled[-1].finish_reason == "kv_sent" and not prefilled[-1].token_ids
        tokens, reason = [], ""
        for response in stream:
            tokens.extend(response.token_ids)
            reason = response.finish_reason or reason
        return tokens, reason, admitted.kv_skip_blocks


def _all_free(redis_url: str) -> None:
    registry = Registry(redis_url)
    deadline = time.monotonic() + 10
    while True:
        states = [m.state for role in ("worker", "prefill") for m in registry.members(role) or []]
        if len(states) == 2 and all(s["free_blocks"] == s["total_blocks"] and not s["reserved_blocks"] for s in states):
            registry.close()
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def test_roles_and_layouts_published(workers: dict[str, local.Process], redis_server: RedisServer) -> None:
    registry = Registry(redis_server.url)
    [decode], [prefill] = registry.members("worker"), registry.members("prefill")
    assert (decode.state["worker_role"], prefill.state["worker_role"]) == ("decode", "prefill")
    assert decode.state["kv_layout"] == prefill.state["kv_layout"] and decode.state["kv_layout"]["model_revision"]
    registry.close()


def test_split_requests_equal_generate(
    workers: dict[str, local.Process], model_dir: Path, redis_server: RedisServer
) -> None:
    """Eight concurrent prompts of 20 to ~200 tokens, each prefilled on the prefill worker in 32-token chunks and
    decoded on the decode worker; then one again, whose prompt blocks the decode worker now caches. Each prompt has
    a cache salt of its own: their chat template's first block is the same, and a prompt admitted after another's
    KV landed would otherwise hit it."""
    adapter = load_model_info(model_dir).adapter
    prompts = [f"question {i}: " + LONG * (i % 4) + "what next?" for i in range(8)]
    sent, received = (
        lambda: metric_value(workers["prefill"].metrics_port, "epd_kv_transfer_bytes_total"),
        lambda: metric_value(workers["decode"].metrics_port, "epd_kv_transfer_bytes_total"),
    )
    before = sent(), received()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _split(workers, _request(adapter, f"pd{i}", prompts[i], 12, f"s{i}")), range(8)))
    for i, (tokens, reason, skip) in enumerate(got):
        expected = hf_generate(model_dir, [ChatMessage("user", [ChatPart("text", prompts[i])])], [], 12)
        assert tokens == expected, i
        assert reason == ("length" if len(expected) == 12 else "stop") and skip == 0
    shipped = sent() - before[0]
    assert shipped > 0 and received() - before[1] == shipped  # every byte sent arrived
    again, _, skip = _split(workers, _request(adapter, "pd-again", prompts[3], 12, "s3"))
    assert skip > 0 and again == got[3][0]
    assert 0 < sent() - before[0] - shipped < shipped / 8  # only the blocks past the decode worker's cached prefix
    _all_free(redis_server.url)


def test_cancel_while_the_kv_is_in_flight_frees_both(
    workers: dict[str, local.Process], model_dir: Path, redis_server: RedisServer
) -> None:
    """The decode worker's stream cancelled once admitted (its reservation freed); the prefill still runs and pushes,
    and its late chunks are dropped there; nothing is held afterwards on either worker."""
    adapter = load_model_info(model_dir).adapter
    request = _request(adapter, "pd-cancel", "cancel me " + LONG * 4, 8)
    decode_address = workers["decode"].address
    with grpc.insecure_channel(decode_address) as d, grpc.insecure_channel(workers["prefill"].address) as p:
        receive = worker_pb2.WorkerRequest()
        receive.CopyFrom(request)
        receive.kv_transfer.direction = "receive"
        stream = worker_pb2_grpc.WorkerStub(d).Generate(receive, timeout=120)
        assert next(stream).admitted
        send = worker_pb2.WorkerRequest()
        send.CopyFrom(request)
        send.kv_transfer.direction, send.kv_transfer.peer = "send", decode_address
        prefilled = worker_pb2_grpc.WorkerStub(p).Generate(send, timeout=120)
        assert next(prefilled).admitted
        stream.cancel()
        cancelled = threading.Event()
        try:
            for response in prefilled:
                assert response.finish_reason in ("", "kv_sent")
        except grpc.RpcError:
            cancelled.set()  # a push the decode worker refused is a clear failure too
    _all_free(redis_server.url)


def test_a_stalled_prefill_past_the_deadline_frees_the_reservation(
    workers: dict[str, local.Process], model_dir: Path, redis_server: RedisServer
) -> None:
    """The prefill worker stopped (SIGSTOP) before it gets the request: the decode worker ends the request
    DEADLINE_EXCEEDED once its KV is EPD_KV_TRANSFER_TIMEOUT_S late, freeing its reservation; resumed, the prefill
    worker prefills and pushes anyway, the decode worker drops the late chunks, and nothing is held on either."""
    adapter = load_model_info(model_dir).adapter
    request = _request(adapter, "pd-stalled", "stalled " + LONG * 2, 8)
    decode_address, prefill = workers["decode"].address, workers["prefill"]
    with grpc.insecure_channel(decode_address) as d, grpc.insecure_channel(prefill.address) as p:
        receive = worker_pb2.WorkerRequest()
        receive.CopyFrom(request)
        receive.kv_transfer.direction = "receive"
        stream = worker_pb2_grpc.WorkerStub(d).Generate(receive, timeout=120)
        assert next(stream).admitted
        send = worker_pb2.WorkerRequest()
        send.CopyFrom(request)
        send.kv_transfer.direction, send.kv_transfer.peer = "send", decode_address
        os.kill(prefill.popen.pid, signal.SIGSTOP)
        try:
            prefilled = worker_pb2_grpc.WorkerStub(p).Generate(send, timeout=120)
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as ended:
                list(stream)
            waited = time.monotonic() - start
        finally:
            os.kill(prefill.popen.pid, signal.SIGCONT)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "did not arrive" in ended.value.details()
        assert waited < DEADLINE_S + 10
        reasons = [r.finish_reason for r in prefilled]
        assert reasons[-1] == "kv_sent"  # pushed after all: the decode worker acknowledged and dropped it
    _all_free(redis_server.url)


def test_image_prompts_split_equal_generate(
    workers: dict[str, local.Process], model_dir: Path, redis_server: RedisServer
) -> None:
    """Prompts of one to three images (M-RoPE positions) beside text, their embeddings pushed to the prefill worker
    only: the decode worker, which never sees an embedding, decodes each as `generate` does."""
    from services.common.media_refs import media_ref
    from services.common.transport_grpc import Embedding, iter_chunks
    from tests.engine_support import build_prompt, image, reference

    adapter = load_model_info(model_dir).adapter
    model = adapter.load_model()
    small, big, tall = image(56, 56, 11), image(224, 224, 12), image(90, 300, 13)
    parts = [[small, "what is this?"], [big, "describe it"], [tall, small, "compare"], ["text " + LONG, big, "and"]]
    prompts = [build_prompt(adapter, model, p) for p in parts]
    with grpc.insecure_channel(workers["prefill"].address) as p:
        items = [Embedding(h, t) for prompt in prompts for h, t in prompt.embeddings.items()]
        ack = worker_pb2_grpc.WorkerStub(p).PushEmbeddings(iter_chunks(items), timeout=60)
        assert ack.items == len(items)

    def split(i: int) -> list[int]:
        prompt = prompts[i]
        request = worker_pb2.WorkerRequest(
            request_id=f"pd-img{i}",
            token_ids=prompt.token_ids,
            media=[media_ref(span) for span in prompt.media],
            sampling=common_pb2.SamplingParams(max_tokens=10),
        )
        return _split(workers, request)[0]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(split, range(len(prompts))))
    for i, prompt in enumerate(prompts):
        assert got[i] == reference(model_dir, prompt, 10), i
    _all_free(redis_server.url)
