"""Prefill/decode disaggregation through the whole cluster: router, encoder, one decode worker and one prefill worker
(`ClusterSpec.prefill_workers`, as `epd up --prefill-workers 1` starts them), real Redis, the tiny Qwen2-VL.

The router sends a request whose uncached prompt tokens reach EPD_PD_MIN_PREFILL_TOKENS to the prefill worker,
which pushes its KV to the decode worker; the tokens come on the decode worker's relay. A second router on the
same workers with the threshold 0 is the co-located reference (its requests are prefilled on the decode worker;
their own cache salt keeps the first router's blocks out of them). Proven here: 16 concurrent requests of text
and one to three images equal transformers' greedy `generate` and the co-located answers; seeded sampling and
logprobs equal the co-located answers; below the threshold a request never reaches the prefill worker, above it
always does (the prefill worker's own count of acknowledged pushes), and a prompt whose prefix the decode worker
holds counts only its uncached part; a prefill worker that is gone or never delivers makes the request prefill
on its decode worker (same tokens); nothing is held on either worker afterwards.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.client import Client, user_request
from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from services.launch import local
from services.launch.health import wait_healthy
from services.models.base import ChatMessage, ChatPart
from tests import media_factory
from tests.integration.conftest import RedisServer, metric_value, model_folder, module_cluster
from tests.oracle import hf_generate

THRESHOLD = 64  # EPD_PD_MIN_PREFILL_TOKENS
MARGIN = 64  # a long prompt's tokens past the threshold: more than the blocks other prompts may share with it
KV_DEADLINE_S = 6.0  # EPD_KV_TRANSFER_TIMEOUT_S: how long the decode worker waits for a remote prefill's KV
MAX_TOKENS = 10
LONG = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm window "


@dataclass
class PD:
    local: local.LocalCluster
    colocated: local.Process  # the second router: threshold 0
    model_dir: Path
    redis_url: str

    @property
    def decode(self) -> local.Process:
        return self.local.workers[0]

    @property
    def prefill(self) -> local.Process:
        return self.local.prefill_workers[0]

    def pushes(self) -> float:
        """Remote prefills the prefill worker finished (its decode worker acknowledged the KV)."""
        return metric_value(self.prefill.metrics_port, "epd_kv_transfer_seconds_count")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"), "qwen2-vl")


def start_pd(
    model_dir: Path,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
    env: dict[str, str] | None = None,
) -> Iterator[PD]:
    """A module's P/D cluster (one prefill worker, threshold ``THRESHOLD``, ``env`` added for every service) and a
    second router over the same services with no threshold (the co-located reference), stopped after its tests."""
    env = {"EPD_PD_MAX_PREFILL_WAITING": "64", "EPD_KV_TRANSFER_TIMEOUT_S": str(KV_DEADLINE_S), **(env or {})}
    cluster = module_cluster(
        model_dir, redis_server, tmp_path_factory, prefill_workers=1, pd_min_prefill_tokens=THRESHOLD, env=env
    )
    started = next(cluster)
    router = started.router.env
    colocated_env = {**router, "EPD_PD_MIN_PREFILL_TOKENS": "0", "EPD_HTTP_PORT": "0"}
    colocated = local.spawn("router", local.free_port(), 0, colocated_env, tmp_path_factory.mktemp("colocated"))
    try:
        wait_healthy(colocated.address, 120, lambda: colocated.popen.poll() is None)
        yield PD(started, colocated, model_dir, redis_server.url)
    finally:
        colocated.popen.terminate()
        colocated.popen.wait(timeout=20)
        next(cluster, None)


@pytest.fixture(scope="module")
def pd(model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    yield from start_pd(model_dir, redis_server, tmp_path_factory)


@dataclass(frozen=True)
class Ask:
    prompt: str
    images: tuple[bytes, ...] = ()

    def request(self, **sampling: object) -> generation_pb2.GenerateRequest:
        return user_request(self.prompt, list(self.images), max_tokens=MAX_TOKENS, **sampling)

    def expected(self, model_dir: Path) -> list[int]:
        from services.common.image_decode import load_image
        from services.common.media import MediaLimits

        parts = [ChatPart("image") for _ in self.images] + [ChatPart("text", self.prompt)]
        images = [load_image(data, MediaLimits()) for data in self.images]
        return hf_generate(model_dir, [ChatMessage("user", parts)], images, MAX_TOKENS)


def _mixed() -> list[Ask]:
    """Sixteen requests: four short (text alone or one small image: under the threshold), twelve long (~80 words of
    text after one to three images of 4 to 64 tokens each)."""
    small, wide = media_factory.png(56, 56, seed=1), media_factory.jpeg(168, 112, seed=2)
    big = media_factory.png(224, 224, seed=3)
    asks = []
    for i in range(16):
        word = ["alpha", "bravo", "charlie", "delta"][i % 4]
        if i % 4 == 0:
            asks.append(Ask(f"{word} {i}: what next?", () if i % 8 == 0 else (small,)))
        else:
            images = [(small,), (wide, small), (big, wide, small)][i % 4 - 1]
            asks.append(Ask(f"{word} {i}: " + LONG * 2 + "what next?", images))
    return asks


def _answer(client: Client, request: generation_pb2.GenerateRequest) -> tuple[list[int], list, generation_pb2.Final]:
    """Token ids, their logprob entries and the final message."""
    tokens, logprobs, final = [], [], None
    for response in client.stream(request, timeout_s=120):
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
            logprobs.extend(response.chunk.logprobs)
        else:
            final = response.final
    return tokens, logprobs, final


def _wait_pushes(pd: PD, expected: float) -> float:
    """The prefill worker's push count once it reached ``expected`` (its metric follows the acknowledgement)."""
    deadline = time.monotonic() + 15
    while (got := pd.pushes()) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def _all_free(pd: PD) -> None:
    """Free == total blocks and nothing reserved on the decode and the prefill worker (as they publish it)."""
    registry = Registry(pd.redis_url)
    ours = {pd.decode.address, pd.prefill.address}
    deadline = time.monotonic() + 15
    try:
        while True:
            members = [m for role in ("worker", "prefill") for m in registry.members(role) or []]
            states = [m.state for m in members if m.address in ours]
            if len(states) == 2 and all(
                s["free_blocks"] == s["total_blocks"] and not s["reserved_blocks"] for s in states
            ):
                return
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
    finally:
        registry.close()


def _labelled(port: int, name: str, label: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def test_mixed_concurrent_requests_equal_generate_and_colocated(pd: PD) -> None:
    asks = _mixed()
    with Client(pd.local.address) as split, Client(pd.colocated.address) as colocated:
        lengths = [split.count(ask.request()).prompt_tokens for ask in asks]
        # below with nothing cached, or above with any prefix the others share cached: never in between
        assert all(n < THRESHOLD or n >= THRESHOLD + MARGIN for n in lengths), lengths
        above = sum(n >= THRESHOLD for n in lengths)
        assert above == 12, lengths
        before = pd.pushes()
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda ask: _answer(split, ask.request())[0], asks))
        assert _wait_pushes(pd, before + above) == before + above  # each long one went to the prefill worker
        with ThreadPoolExecutor(16) as pool:
            reference = list(pool.map(lambda a: _answer(colocated, a.request(cache_salt="colocated"))[0], asks))
        assert pd.pushes() == before + above  # the co-located router never sends one there
    for i, ask in enumerate(asks):
        assert got[i] == ask.expected(pd.model_dir), (i, lengths[i])
        assert reference[i] == got[i], i
    _all_free(pd)


def test_seeded_sampling_and_logprobs_equal_colocated(pd: PD) -> None:
    asks = [Ask("sample " + LONG * 2), Ask("sample this " + LONG, (media_factory.png(224, 224, seed=7),))]
    with Client(pd.local.address) as split, Client(pd.colocated.address) as colocated:
        before = pd.pushes()
        for i, ask in enumerate(asks):
            request = ask.request(temperature=1.0, seed=1234 + i)
            request.sampling.logprobs = 3
            tokens, logprobs, _ = _answer(split, request)
            request.cache_salt = "colocated-seeded"
            ref_tokens, ref_logprobs, _ = _answer(colocated, request)
            assert tokens == ref_tokens and len(tokens) == MAX_TOKENS, i
            assert [e.token_id for e in logprobs] == tokens
            for mine, theirs in zip(logprobs, ref_logprobs, strict=True):
                assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
                assert [t.token_id for t in mine.top] == [t.token_id for t in theirs.top]
        assert _wait_pushes(pd, before + len(asks)) == before + len(asks)
    _all_free(pd)


def test_threshold_counts_only_the_uncached_part(pd: PD) -> None:
    """Short: local. Long: remote. The long one again with a few words more: its prefix is on the decode worker,
    so only the new blocks count, below the threshold: local, its prefix served from the decode worker's cache."""
    short, long = Ask("hi there"), Ask("story: " + LONG * 3)
    longer = Ask(long.prompt + " and then?")
    with Client(pd.local.address) as client:
        lengths = [client.count(a.request()).prompt_tokens for a in (short, long, longer)]
        assert lengths[0] < THRESHOLD and lengths[1] >= THRESHOLD + MARGIN and lengths[2] > lengths[1], lengths
        start = pd.pushes()
        assert _answer(client, short.request())[0] == short.expected(pd.model_dir)
        tokens, _, _ = _answer(client, long.request())
        assert tokens == long.expected(pd.model_dir)
        assert _wait_pushes(pd, start + 1) == start + 1
        tokens, _, final = _answer(client, longer.request())
        assert tokens == longer.expected(pd.model_dir)
        assert final.usage.cached_tokens >= lengths[1] - 32  # the decode worker's blocks, from the remote prefill
        assert pd.pushes() == start + 1  # neither the short one nor the cached one went there
    _all_free(pd)


class _Stalled(worker_pb2_grpc.WorkerServicer):
    """A prefill worker that admits and never delivers."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        self.calls += 1
        yield worker_pb2.WorkerResponse(admitted=True, state_at=time.time())
        while context.is_active() and not self.release.wait(0.1):
            pass


@pytest.fixture
def impostor(pd: PD) -> Iterator[Callable[[str], None]]:
    """Registers a prefill worker at an address of the test's choosing, idler and larger than the real one (so the
    router picks it), for as long as the test runs."""
    registry = Registry(pd.redis_url)
    [real] = registry.members("prefill")
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def register(address: str) -> None:
        state = {**real.state, "waiting": 0, "running": 0, "reserved_blocks": 0}
        state["total_blocks"] = state["capacity_blocks"] = 10 * int(real.state["capacity_blocks"])

        def beat() -> None:
            while not stop.is_set():
                registry.publish("prefill", address, real.revision, {**state, "snapshot_at": time.time()})
                stop.wait(0.2)

        threads.append(threading.Thread(target=beat, daemon=True))
        threads[-1].start()
        time.sleep(0.5)  # the router's view (refreshed every 0.1 s) has it

    yield register
    stop.set()
    for thread in threads:
        thread.join()
    for member in registry.members("prefill") or []:
        if member.address != real.address:
            registry.withdraw("prefill", member.address)
    registry.close()
    time.sleep(0.3)


def test_a_prefill_worker_that_is_gone_falls_back_to_local(pd: PD, impostor) -> None:
    impostor(f"127.0.0.1:{local.free_port()}")  # nothing listens there
    ask = Ask("gone: " + LONG * 3)
    before = _labelled(pd.local.router.metrics_port, "epd_migrations_total", 'reason="prefill"')
    with Client(pd.local.address) as client:
        tokens, _, final = _answer(client, ask.request())
    assert tokens == ask.expected(pd.model_dir) and final.usage.migrations == 1
    assert _labelled(pd.local.router.metrics_port, "epd_migrations_total", 'reason="prefill"') == before + 1
    _all_free(pd)


def test_a_prefill_past_the_kv_deadline_falls_back_to_local(pd: PD, impostor) -> None:
    stalled = _Stalled()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_WorkerServicer_to_server(stalled, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        impostor(f"127.0.0.1:{port}")
        ask = Ask("stalled: " + LONG * 3)
        with Client(pd.local.address) as client:
            start = time.monotonic()
            tokens, _, final = _answer(client, ask.request())
            waited = time.monotonic() - start
        assert stalled.calls == 1 and tokens == ask.expected(pd.model_dir) and final.usage.migrations == 1
        assert KV_DEADLINE_S <= waited < KV_DEADLINE_S + 30  # the decode worker's deadline, then a local prefill
    finally:
        stalled.release.set()
        server.stop(0)
    _all_free(pd)
