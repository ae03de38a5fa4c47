"""Load and checks shared by the reliability tests and `epd bench soak`: fixed requests, outcomes, settled KV.

A client here talks to one or several routers over one channel (round robin over the routers whose health
is SERVING, and gRPC's own retry of UNAVAILABLE before any answer arrived: what a client behind router
replicas does). Every request's outcome
is kept, the failures with their status, so a test can say "0 failed" and show the ones that did.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from services.client import user_request
from services.common.grpc_server import channel_options
from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2, generation_pb2_grpc
from tests import media_factory

RETRY_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": "epd.v1.Generation"},
    "methodConfig": [
        {
            "name": [{"service": "epd.v1.Generation"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.2s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}


def balanced_stub(addresses: Sequence[str]) -> tuple[grpc.Channel, generation_pb2_grpc.GenerationStub]:
    """One channel over every router address (round robin over those whose gRPC health watch says SERVING, so a
    draining router gets no new call; UNAVAILABLE retried before any answer). A router
    that was down is tried again within half a second (gRPC's default reconnect back-off grows to minutes:
    after a long restart the channel would not see it back before the next router goes down)."""
    target = "ipv4:" + ",".join(addresses)
    options = [
        *channel_options(),
        ("grpc.service_config", json.dumps(RETRY_CONFIG)),
        ("grpc.enable_retries", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]
    channel = grpc.insecure_channel(target, options=options)
    return channel, generation_pb2_grpc.GenerationStub(channel)


def image_request(i: int, max_tokens: int, salt: str = "", size: int = 64) -> generation_pb2.GenerateRequest:
    """Request `i`: one image of its own (seeded by `i`), a short prompt, greedy, eos ignored."""
    image = media_factory.png(size + i % 7 * 4, size - i % 5 * 4, seed=10_000 + i)
    request = user_request(f"describe picture {i}", [image], max_tokens=max_tokens, cache_salt=salt)
    request.sampling.ignore_eos = True
    return request


def text_request(i: int, max_tokens: int, salt: str = "") -> generation_pb2.GenerateRequest:
    request = user_request(f"tell me about number {i} " * (1 + i % 4), max_tokens=max_tokens, cache_salt=salt)
    request.sampling.ignore_eos = True
    return request


@dataclass
class Outcome:
    """How one request ended: its tokens and usage, or its status; and how long it took, retries included."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    final: generation_pb2.Final | None = None
    code: grpc.StatusCode | None = None
    details: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.code is None and self.final is not None

    @property
    def migrations(self) -> int:
        return self.final.usage.migrations if self.final is not None else 0


CONNECT_RETRY_S = 30.0
"""How long a request that reached no router at all (every router address refusing connections, as during a
rolling restart on a loaded box) is sent again, as a client behind router replicas retries; a status that
a router returned is never retried."""


def _unreached(code: grpc.StatusCode, details: str) -> bool:
    """The call failed before any router took it: gRPC found no connectable address."""
    text = details.lower()
    return code == grpc.StatusCode.UNAVAILABLE and ("failed to connect" in text or "connection refused" in text)


def stream_one(
    stub: generation_pb2_grpc.GenerationStub,
    index: int,
    request: generation_pb2.GenerateRequest,
    timeout_s: float,
    on_chunk: Callable[[int], None] = lambda index: None,
) -> Outcome:
    start = time.monotonic()
    deadline = start + CONNECT_RETRY_S
    while True:
        outcome = Outcome(index)
        try:
            for response in stub.Generate(request, timeout=timeout_s):
                if response.HasField("chunk"):
                    outcome.token_ids.extend(response.chunk.token_ids)
                    on_chunk(index)
                else:
                    outcome.final = response.final
        except grpc.RpcError as exc:
            outcome.code, outcome.details = exc.code(), exc.details() or ""
        outcome.seconds = time.monotonic() - start
        if outcome.token_ids or not _unreached(outcome.code, outcome.details) or time.monotonic() > deadline:
            return outcome
        time.sleep(0.5)


def run_all(
    addresses: Sequence[str],
    requests: Sequence[generation_pb2.GenerateRequest],
    timeout_s: float = 120.0,
    on_chunk: Callable[[int], None] = lambda index: None,
) -> list[Outcome]:
    """Send every request at once (a thread each) and wait for all; outcomes in request order."""
    channel, stub = balanced_stub(addresses)
    with channel, ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(stream_one, stub, i, r, timeout_s, on_chunk) for i, r in enumerate(requests)]
        return [f.result() for f in futures]


class Load:
    """`clients` threads sending requests back to back (from `make(i)`) until stopped; every outcome kept."""

    def __init__(
        self,
        addresses: Sequence[str],
        make: Callable[[int], generation_pb2.GenerateRequest],
        clients: int = 4,
        timeout_s: float = 120.0,
    ) -> None:
        self._channel, self._stub = balanced_stub(addresses)
        self._make, self._clients, self._timeout_s = make, clients, timeout_s
        self._stop = threading.Event()
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self._pool = ThreadPoolExecutor(clients)

    def _loop(self) -> None:
        while not self._stop.is_set():
            i = next(self._numbers)
            outcome = stream_one(self._stub, i, self._make(i), self._timeout_s)
            with self._lock:
                self.outcomes.append(outcome)

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if not o.ok]

    def __enter__(self) -> Load:
        for _ in range(self._clients):
            self._pool.submit(self._loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)
        self._channel.close()


def describe(failures: Sequence[Outcome]) -> str:
    return "; ".join(f"#{o.index} {o.code.name if o.code else 'no final'}: {o.details}" for o in failures[:10])


def settled_workers(redis_url: str, count: int, timeout_s: float = 120.0) -> list[dict]:
    """Poll the registry until `count` workers publish an idle, leak-free state (free == total blocks, nothing
    reserved, running, waiting or pinned); return their states, or fail with the last ones seen."""
    registry = Registry(redis_url)
    states: list[dict] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            states = [m.state for m in registry.members("worker") or []]
            if len(states) == count and all(_idle(s) for s in states):
                return states
            time.sleep(0.2)
    finally:
        registry.close()
    raise AssertionError(f"workers never settled to {count} idle, leak-free states: {states}")


def _idle(state: dict) -> bool:
    return (
        state["free_blocks"] == state["total_blocks"]
        and state["reserved_blocks"] == 0
        and state["running"] == 0
        and state["waiting"] == 0
        and state.get("pinned_embeddings", 0) == 0
    )


def metric_by_label(port: int, name: str, label: str) -> dict[str, float]:
    """A counter's samples on a Prometheus endpoint, by the value of one label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class StreamsStarted:
    """`run_all`'s `on_chunk` noting which streams have had a chunk; `wait` returns once all `count` have."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.started: set[int] = set()
        self._all = threading.Event()

    def __call__(self, index: int) -> None:
        self.started.add(index)
        if len(self.started) >= self.count:
            self._all.set()

    def wait(self, timeout_s: float = 120.0) -> None:
        assert self._all.wait(timeout_s), f"only {len(self.started)} of {self.count} streams started"
