"""Prefill/decode disaggregation under faults, each under 16-way load: kill -9 of the prefill worker while it
transfers, SIGSTOP of it past the decode workers' KV deadline, kill -9 of a decode worker after first tokens,
and client cancels spread over a request's states (queued at the prefill worker, prefilling, transferring,
decoding).

One cluster for the module (router, encoder, two decode workers, one prefill worker, as `epd up --workers 2
--prefill-workers 1` starts them), supervised as `epd up` does, so a killed process comes back. Every request is
long enough to be prefilled remotely (a cache salt per run keeps the decode workers' prefix caches out of it),
greedy with eos ignored; outputs are compared token for token with the same requests in an undisturbed run.
Every request completes or ends with a clear status (none hangs: a generous client deadline would show it), and
afterwards every worker, prefill worker included, publishes free == total blocks with nothing reserved.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.client import user_request
from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2
from services.launch import local
from services.launch.health import wait_healthy
from services.launch.supervisor import Supervisor
from tests.integration.conftest import RedisServer
from tests.reliability_support import StreamsStarted, balanced_stub, describe, metric_by_label, run_all, settled_workers

STREAMS, TOKENS = 16, 24
THRESHOLD = 64  # EPD_PD_MIN_PREFILL_TOKENS
KV_DEADLINE_S = 5.0  # EPD_KV_TRANSFER_TIMEOUT_S
LONG = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm window "


@dataclass
class PD:
    cluster: local.LocalCluster
    supervisor: Supervisor

    @property
    def prefill(self) -> local.Process:
        return self.cluster.prefill_workers[0]

    def sent(self) -> float:
        """Remote prefills the router saw acknowledged."""
        return metric_by_label(self.cluster.router.metrics_port, "epd_remote_prefills_total", "outcome").get("sent", 0)

    def prefill_migrations(self) -> float:
        by_reason = metric_by_label(self.cluster.router.metrics_port, "epd_migrations_total", "reason")
        return by_reason.get("prefill", 0.0)


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    env = {
        "EPD_KV_TRANSFER_TIMEOUT_S": str(KV_DEADLINE_S),
        "EPD_PD_MAX_PREFILL_WAITING": "64",
        "EPD_MAX_NUM_BATCHED_TOKENS": "64",  # chunked prefills: several steps (and chunks) per request
    }
    spec = local.ClusterSpec(
        tiny_model_dir,
        workers=2,
        prefill_workers=1,
        pd_min_prefill_tokens=THRESHOLD,
        redis_url=redis_server.url,
        free_ports=True,
        log_dir=tmp_path_factory.mktemp("logs"),
        env=env,
    )
    cluster = local.start_cluster(spec)
    try:
        with Supervisor(cluster.processes, report=lambda line: None) as supervisor:
            yield PD(cluster, supervisor)
    finally:
        cluster.stop()


def _requests(salt: str) -> list[generation_pb2.GenerateRequest]:
    requests = []
    for i in range(STREAMS):
        request = user_request(f"story {i}: " + LONG * (3 + i % 3), max_tokens=TOKENS, cache_salt=salt)
        request.sampling.ignore_eos = True
        requests.append(request)
    return requests


def _settled(pd: PD) -> None:
    """Every service answers health; both decode workers and the prefill worker idle, nothing held."""
    for process in pd.cluster.processes:
        wait_healthy(process.address, 180, lambda: True)
    settled_workers(pd.cluster.redis_url, 2)
    registry = Registry(pd.cluster.redis_url)
    deadline = time.monotonic() + 120
    try:
        while True:
            states = [m.state for m in registry.members("prefill") or []]
            if len(states) == 1 and all(
                s["free_blocks"] == s["total_blocks"] and not s["reserved_blocks"] and not s["running"] for s in states
            ):
                return
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
    finally:
        registry.close()


def _router_pairs_the_prefill_worker(pd: PD) -> None:
    """Until a long request goes to the prefill worker: the router's cluster view, refreshed from the registry a
    few times a second, may not hold it yet when the registry already does (each probe has a salt of its own)."""
    deadline = time.monotonic() + 60
    for probe in range(1000):
        before = pd.sent()
        [outcome] = run_all([pd.cluster.address], _requests(f"probe-{probe}")[:1])
        assert outcome.ok, describe([outcome])
        waited = time.monotonic() + 5
        while pd.sent() == before and time.monotonic() < waited:
            time.sleep(0.05)
        if pd.sent() > before:
            return
        assert time.monotonic() < deadline, "the router never sent a long prompt to the prefill worker"


@pytest.fixture(scope="module")
def calm(pd: PD) -> list[list[int]]:
    """The undisturbed run's outputs: every request prefilled on the prefill worker."""
    _settled(pd)
    _router_pairs_the_prefill_worker(pd)
    _settled(pd)
    before = pd.sent()
    outcomes = run_all([pd.cluster.address], _requests("calm"))
    assert all(o.ok and len(o.token_ids) == TOKENS for o in outcomes), describe([o for o in outcomes if not o.ok])
    assert sum(o.migrations for o in outcomes) == 0
    deadline = time.monotonic() + 15
    while pd.sent() < before + STREAMS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pd.sent() == before + STREAMS  # each went to the prefill worker
    _settled(pd)
    return [o.token_ids for o in outcomes]


def _disturbed(pd: PD, salt: str, fault, when) -> list:  # noqa: ANN001
    """Run the requests; once `when()` holds, `fault()`; every outcome."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, [pd.cluster.address], _requests(salt), 120.0)
        deadline = time.monotonic() + 60
        while not when() and time.monotonic() < deadline and not running.done():
            time.sleep(0.01)
        assert not running.done(), "the run ended before the fault"
        fault()
        return running.result()


def _same_as_calm(outcomes: list, calm: list[list[int]]) -> None:
    assert all(o.ok for o in outcomes), describe([o for o in outcomes if not o.ok])
    for outcome, quiet in zip(outcomes, calm, strict=True):
        assert outcome.token_ids == quiet, f"request {outcome.index} ({outcome.migrations} migrations)"


def test_prefill_worker_killed_while_it_transfers(pd: PD, calm: list[list[int]]) -> None:
    """kill -9 of the prefill worker once some of the 16 prefills were acknowledged and the others are queued,
    prefilling or transferring there: those fall back to a local prefill on their decode workers."""
    start, moved = pd.sent(), pd.prefill_migrations()
    outcomes = _disturbed(
        pd, "killed-prefill", lambda: os.kill(pd.prefill.popen.pid, signal.SIGKILL), lambda: pd.sent() >= start + 3
    )
    _same_as_calm(outcomes, calm)
    assert pd.prefill_migrations() > moved  # some were in flight at the prefill worker
    _settled(pd)  # the supervisor started it again; nothing held anywhere


def test_prefill_worker_stopped_past_the_kv_deadline(pd: PD, calm: list[list[int]]) -> None:
    """SIGSTOP of the prefill worker mid-load: the requests it holds wait out the decode workers' KV deadline and
    fall back to a local prefill; once it resumes, its late pushes are dropped and it frees everything."""
    _settled(pd)
    _router_pairs_the_prefill_worker(pd)  # restarted after the kill above: the router's view may not hold it yet
    start, moved = pd.sent(), pd.prefill_migrations()
    pid = pd.prefill.popen.pid
    sent_at_stop: list[float] = []

    def stop() -> None:
        os.kill(pid, signal.SIGSTOP)
        sent_at_stop.append(pd.sent() - start)

    try:  # stopped at the first acknowledged prefill: a later trigger let a busy box's 16 prefills all end first
        outcomes = _disturbed(pd, "stopped-prefill", stop, lambda: pd.sent() >= start + 1)
    finally:
        os.kill(pid, signal.SIGCONT)
    _same_as_calm(outcomes, calm)
    assert pd.prefill_migrations() > moved, f"{sent_at_stop[0]:g} of {STREAMS} prefills were sent when it stopped"
    _settled(pd)


def test_decode_worker_killed_after_first_tokens(pd: PD, calm: list[list[int]]) -> None:
    """kill -9 of a decode worker once every stream has tokens: its requests continue on the other decode worker
    (prefilled remotely again: prompt and tokens so far), token for token as undisturbed."""
    _settled(pd)
    on_chunk = StreamsStarted(STREAMS)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_all, [pd.cluster.address], _requests("killed-decode"), 120.0, on_chunk)
        on_chunk.wait(120)
        os.kill(pd.cluster.workers[0].popen.pid, signal.SIGKILL)
        outcomes = running.result()
    _same_as_calm(outcomes, calm)
    assert sum(o.migrations for o in outcomes) > 0
    _settled(pd)


def test_client_cancels_in_every_state_free_everything(pd: PD) -> None:
    """Cancels at 0, 20, 60 and 150 ms after sending (queued at the prefill worker, prefilling, transferring, just
    decoding, as the 16 prefills queue there) and after the first and third chunks: each ends CANCELLED or
    completes, and nothing is held anywhere afterwards."""
    _settled(pd)
    channel, stub = balanced_stub([pd.cluster.address])
    plans = [("after", d) for d in (0.0, 0.02, 0.06, 0.15)] + [("chunks", 1), ("chunks", 3)]

    def one(i: int) -> str:
        kind, at = plans[i % len(plans)]
        call = stub.Generate(_requests(f"cancel-{i}")[i], timeout=120)
        timer = threading.Timer(at, call.cancel) if kind == "after" else None
        if timer is not None:
            timer.start()
        chunks = 0
        try:
            for response in call:
                chunks += response.HasField("chunk")
                if kind == "chunks" and chunks >= at:
                    call.cancel()
            return "completed"
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED, (i, exc.code(), exc.details())
            return "cancelled"
        finally:
            if timer is not None:
                timer.cancel()

    with channel, ThreadPoolExecutor(STREAMS) as pool:
        ends = list(pool.map(one, range(STREAMS)))
    assert ends.count("cancelled") >= STREAMS // 2, ends
    _settled(pd)
