"""Security and tenancy for real: mTLS, Redis AUTH/TLS, API keys, tenant isolation and limits.

Router, encoder and worker in their own processes with mTLS on every hop, Redis with a password over TLS, API
keys that name tenants, signed embedding cache entries and per-tenant limits. Certificates are made here
(tests/certs.py).

Tenants: `small` may run one request at a time and project SMALL_TPM tokens a minute; the others are
unlimited. `gamma`/`delta` and `epsilon`/`zeta` send nothing before their isolation tests (their chat
template's first block would otherwise be cached for them already).
"""

from __future__ import annotations

import json
import os
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.client import Client, user_request
from services.common.cache_hmac import MAGIC, TAG_BYTES
from services.common.embedding_cache import pack, unpack
from services.common.hashing import mm_hash
from services.common.model_info import load_model_info
from services.common.registry import Registry
from services.common.rpc.epd.v1 import common_pb2, generation_pb2, worker_pb2, worker_pb2_grpc
from services.common.tls import ClientTls, TlsFiles
from services.launch.health import check
from services.launch.local import ClusterSpec, LocalCluster, Process, free_port, spawn, start_cluster
from services.router.auth import key_digest
from services.router.tenants import item_key
from tests import media_factory
from tests.certs import CertAuthority, Pair
from tests.integration.conftest import metric_value
from tests.loopback_http import serving
from tests.secure_redis import SecureRedis

KEYS = {t: f"key-{t}" for t in ("alpha", "beta", "small", "gamma", "delta", "epsilon", "zeta")}
SMALL_TPM = 3000
PROMPT = "Describe the picture in a few words, please, and say what colours it has."


@dataclass
class Secure:
    cluster: LocalCluster
    model_dir: Path
    redis: SecureRedis
    ca: CertAuthority
    other_ca: CertAuthority
    client_pair: Pair
    rogue_pair: Pair
    keys_file: Path
    env: dict[str, str]
    folder: Path

    def client(self, tenant: str | None = "alpha", address: str | None = None) -> Client:
        credentials = grpc.ssl_channel_credentials(self.ca.cert_file.read_bytes())
        return Client(address or self.cluster.address, credentials, KEYS[tenant] if tenant else "")

    def internal(self) -> ClientTls:
        """A client of the cluster CA with its own certificate (what services and the launcher use)."""
        return ClientTls(
            TlsFiles(str(self.client_pair.cert_file), str(self.client_pair.key_file), str(self.ca.cert_file))
        )

    def https(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        context = ssl.create_default_context(cafile=str(self.ca.cert_file))
        return httpx.Client(base_url=f"https://127.0.0.1:{self.cluster.http_port}", verify=context, headers=headers)

    def metric(self, process: Process, name: str) -> float:
        return metric_value(process.metrics_port, name)

    def router_metric(self, name: str, *labels: str, router: Process | None = None) -> float:
        port = (router or self.cluster.router).metrics_port
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(label in line for label in labels)
        )


def write_keys(path: Path, keys: dict[str, str]) -> None:
    """Replace the keys file as a Secret update does (a new file renamed over the old one)."""
    path.with_suffix(".new").write_text(
        "# tenant  sha256(key)\n" + "".join(f"{t} {key_digest(k)}\n" for t, k in keys.items())
    )
    os.replace(path.with_suffix(".new"), path)


@pytest.fixture(scope="module")
def secure(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    folder = tmp_path_factory.mktemp("security")
    ca, other = CertAuthority.create(folder, "cluster"), CertAuthority.create(folder, "other")
    services, client, rogue = ca.issue(folder, "services"), ca.issue(folder, "client"), other.issue(folder, "rogue")
    keys_file, limits_file, hmac_file = folder / "api-keys", folder / "limits", folder / "cache-key"
    write_keys(keys_file, KEYS)
    limits_file.write_text(f"small concurrency=1 tokens_per_minute={SMALL_TPM}\n")
    hmac_file.write_bytes(os.urandom(32).hex().encode())
    with SecureRedis.running(folder / "redis") as redis_server:
        env = {
            "EPD_TLS_CERT_FILE": str(services.cert_file),
            "EPD_TLS_KEY_FILE": str(services.key_file),
            "EPD_TLS_CA_FILE": str(ca.cert_file),
            "EPD_API_KEYS_FILE": str(keys_file),
            "EPD_TENANT_LIMITS_FILE": str(limits_file),
            "EPD_CACHE_HMAC_KEY_FILE": str(hmac_file),
            "EPD_FETCH_ALLOW_LOOPBACK_FOR_TESTS": "true",
        }
        spec = ClusterSpec(
            tiny_model_dir, redis_url=redis_server.url(), free_ports=True, env=env, log_dir=folder / "logs"
        )
        cluster = start_cluster(spec)
        try:
            yield Secure(cluster, tiny_model_dir, redis_server, ca, other, client, rogue, keys_file, env, folder)
        finally:
            cluster.stop()


def generate(client: Client, request: generation_pb2.GenerateRequest) -> generation_pb2.Final:
    with client:
        answer = client.generate(request, timeout_s=120)
    assert answer.final is not None and answer.token_ids
    return answer.final


def endless(prompt: str, max_tokens: int = 2000) -> generation_pb2.GenerateRequest:
    """A text request that runs for a while (it ignores end-of-sequence)."""
    request = user_request(prompt, max_tokens=max_tokens)
    request.sampling.ignore_eos = True
    return request


def refused(call, code: grpc.StatusCode) -> grpc.RpcError:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value
    return caught.value


# TLS on every hop ------------------------------------------------------------------------------


def test_a_client_with_the_ca_and_a_key_gets_answers(secure: Secure) -> None:
    final = generate(secure.client(), user_request(PROMPT, [media_factory.png(64, 64, seed=1)], max_tokens=6))
    assert final.usage.image_tokens > 0
    with secure.https(KEYS["alpha"]) as http:
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        response = http.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_plaintext_and_foreign_ca_clients_fail_the_handshake(secure: Secure) -> None:
    request = user_request("hi", max_tokens=2)
    plaintext = Client(secure.cluster.address, api_key=KEYS["alpha"])
    refused(lambda: plaintext.generate(request, timeout_s=10), grpc.StatusCode.UNAVAILABLE)
    trusts_other = Client(
        secure.cluster.address, grpc.ssl_channel_credentials(secure.other_ca.cert_file.read_bytes()), KEYS["alpha"]
    )
    refused(lambda: trusts_other.generate(request, timeout_s=10), grpc.StatusCode.UNAVAILABLE)
    for each in (plaintext, trusts_other):
        each.close()
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS listener
        httpx.get(f"http://127.0.0.1:{secure.cluster.http_port}/health", timeout=10)
    context = ssl.create_default_context(cafile=str(secure.other_ca.cert_file))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://127.0.0.1:{secure.cluster.http_port}/health", verify=context, timeout=10)


def test_internal_ports_take_only_clients_of_the_cluster_ca(secure: Secure) -> None:
    internal = [*secure.cluster.encoders, *secure.cluster.workers]
    ca_only = grpc.ssl_channel_credentials(secure.ca.cert_file.read_bytes())
    foreign_cert = grpc.ssl_channel_credentials(
        secure.ca.cert_file.read_bytes(),
        secure.rogue_pair.key_file.read_bytes(),
        secure.rogue_pair.cert_file.read_bytes(),
    )
    for process in internal:
        assert check(process.address, tls=secure.internal()), f"{process.role} must answer the cluster's own client"
        assert not check(process.address), f"{process.role} {process.address} answered a plaintext client"
        for credentials in (ca_only, foreign_cert):  # no client certificate; one of another CA
            with grpc.secure_channel(process.address, credentials) as channel:
                refused(
                    lambda channel=channel: health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=5
                    ),
                    grpc.StatusCode.UNAVAILABLE,
                )
    worker = secure.cluster.workers[0].address
    with grpc.secure_channel(worker, ca_only) as channel:  # a direct Generate bypassing the router
        stream = worker_pb2_grpc.WorkerStub(channel).Generate(worker_pb2.WorkerRequest(token_ids=[1, 2]), timeout=5)
        refused(lambda: list(stream), grpc.StatusCode.UNAVAILABLE)


# Registration cannot redirect traffic; a tampered cache entry is a miss ----------------


@contextmanager
def rogue_worker(secure: Secure, log: Path) -> Iterator[str]:
    registry = Registry(secure.redis.url())
    real = registry.members("worker")
    assert real, "the real worker is not registered"
    state = {**real[0].state, "reserved_blocks": 0, "running": 0, "waiting": 0}
    command = [sys.executable, "-m", "tests.rogue_worker", "--redis-url", secure.redis.url()]
    command += ["--revision", real[0].revision, "--state", json.dumps(state)]
    command += ["--cert", str(secure.rogue_pair.cert_file), "--key", str(secure.rogue_pair.key_file), "--log", str(log)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        line = process.stdout.readline()
        assert line.startswith("READY "), line
        yield line.split()[1]
    finally:
        process.terminate()
        process.wait(timeout=10)
        registry.withdraw("worker", line.split()[1] if line.startswith("READY ") else "")
        registry.close()


def test_a_registered_worker_without_a_cluster_certificate_gets_no_request(secure: Secure) -> None:
    log = secure.folder / "rogue.log"
    with rogue_worker(secure, log) as address, secure.https(None) as http:
        deadline = time.monotonic() + 10
        while http.get("/health", timeout=10).json().get("workers") != 2:
            assert time.monotonic() < deadline, "the router never saw the rogue worker"
            time.sleep(0.1)
        # a long request keeps the real worker loaded, so the idle-looking rogue ranks first
        busy = secure.client("beta")
        hold = busy.stream(endless("Count to many."), timeout_s=120)
        next(iter(hold))
        try:
            for i in range(3):
                final = generate(secure.client(), user_request(f"Fresh prompt number {i} for the rogue.", max_tokens=3))
                assert final.usage.completion_tokens == 3
        finally:
            hold.cancel()
            busy.close()
    lines = log.read_text().splitlines() if log.exists() else []
    assert "connect" in lines, f"the router never tried the rogue at {address}: the test proves nothing"
    assert not [line for line in lines if line.startswith("rpc")], lines


def cache_key(secure: Secure, data: bytes, tenant: str) -> str:
    """The Redis key of `data`'s embedding for `tenant` (embeddings not shared across tenants)."""
    info = load_model_info(secure.model_dir)
    return f"epd:emb:{info.identity.revision}:{item_key(mm_hash(info.identity, 'image', data), tenant, shared=False)}"


def test_a_tampered_cache_entry_is_a_miss_and_the_answer_is_unchanged(secure: Secure) -> None:
    image = media_factory.png(80, 48, seed=21)
    request = user_request(PROMPT, [image], max_tokens=8)
    store = redis.Redis.from_url(secure.redis.url())
    clean = generate(secure.client("beta"), request)
    signed = store.get(cache_key(secure, image, "beta"))
    assert signed.startswith(MAGIC)
    real = unpack(signed[len(MAGIC) + TAG_BYTES :])
    forged = pack(torch.zeros_like(real))  # well formed, the right shape, unsigned: what a Redis writer can plant
    alpha_key = cache_key(secure, image, "alpha")
    store.set(alpha_key, forged)
    hits = secure.router_metric("epd_embedding_cache_hits_total")
    with secure.client("alpha") as alpha, secure.client("beta") as beta:
        poisoned = alpha.generate(request)
        assert secure.router_metric("epd_embedding_cache_hits_total") == hits, "the forged entry counted as a hit"
        assert poisoned.text == beta.generate(request).text
    assert poisoned.final.usage.image_tokens == clean.usage.image_tokens
    rewritten = store.get(alpha_key)
    assert rewritten != forged and rewritten.startswith(MAGIC), "the encoder should have replaced the forged entry"
    store.set(alpha_key, rewritten[:-4] + b"\x00\x00\x80\x7f")  # one value changed under a good-looking tag
    hits = secure.router_metric("epd_embedding_cache_hits_total")
    with secure.client("alpha") as alpha:
        assert alpha.generate(request).text == poisoned.text
    assert secure.router_metric("epd_embedding_cache_hits_total") == hits
    store.close()


# API keys ------------------------------------------------------------------------------------------


@contextmanager
def counting_media(data: bytes) -> Iterator[tuple[str, list[str]]]:
    """An http media URL on loopback and the list of paths it was asked for."""
    asked: list[str] = []
    with serving(data, "/picture.png", asked) as url:
        yield url, asked


def url_request(url: str, max_tokens: int = 4) -> generation_pb2.GenerateRequest:
    parts = [generation_pb2.ContentPart(image=generation_pb2.Media(url=url)), generation_pb2.ContentPart(text=PROMPT)]
    return generation_pb2.GenerateRequest(
        messages=[generation_pb2.Message(role="user", content=parts)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


def work_done(secure: Secure) -> tuple[float, ...]:
    """Counters that move when a request is fetched, encoded, reserved or counted at all."""
    return (
        secure.metric(secure.cluster.encoders[0], "epd_encoder_items_encoded_total"),
        prefixed_sum(secure.cluster.workers[0], "epd_prompt_tokens"),
        secure.router_metric("epd_requests_total"),
        secure.router_metric("epd_admission_rejections_total"),
    )


def prefixed_sum(process: Process, prefix: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_missing_or_wrong_keys_are_refused_before_any_work(secure: Secure) -> None:
    image = media_factory.png(72, 72, seed=31)
    credentials = grpc.ssl_channel_credentials(secure.ca.cert_file.read_bytes())
    with counting_media(image) as (url, asked):
        before = work_done(secure)
        request = url_request(url)
        seconds: list[float] = []
        for key in ("", "wrong-key", KEYS["alpha"] + "x"):
            with Client(secure.cluster.address, credentials, key) as client:
                client.wait_ready(30)
                for _ in range(10):
                    start = time.perf_counter()
                    refused(
                        lambda client=client: client.generate(request, timeout_s=30), grpc.StatusCode.UNAUTHENTICATED
                    )
                    seconds.append(time.perf_counter() - start)
                refused(lambda client=client: client.count(request), grpc.StatusCode.UNAUTHENTICATED)
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        for key in (None, "wrong-key"):
            with secure.https(key) as http:
                for path in ("/v1/chat/completions", "/v1/count_tokens", "/tokenize"):
                    answer = http.post(path, json=body, timeout=30)
                    assert answer.status_code == 401, answer.text
                    assert answer.json()["error"]["type"] == "authentication_error"
                assert http.post("/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 401
                assert http.post("/detokenize", json={"tokens": [1]}, timeout=30).status_code == 401
                assert http.get("/v1/models", timeout=30).status_code == 401
                for path in ("/health", "/version", "/openapi.json"):  # these stay open
                    assert http.get(path, timeout=30).status_code == 200, path
        assert asked == [], "a refused request fetched its media URL"
        assert work_done(secure) == before, "a refused request did work (encode, reserve or count)"
        print(
            f"UNAUTHENTICATED round trip over TLS: median {statistics.median(seconds) * 1000:.2f} ms, "
            f"max {max(seconds) * 1000:.2f} ms over {len(seconds)}"
        )
        final = generate(secure.client("alpha"), request)
        assert asked == ["/picture.png"] and final.usage.image_tokens > 0


def test_health_and_reflection_need_no_key(secure: Secure) -> None:
    credentials = grpc.ssl_channel_credentials(secure.ca.cert_file.read_bytes())
    with grpc.secure_channel(secure.cluster.address, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([ask]), timeout=10))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "epd.v1.Generation" in names


def test_rotating_the_keys_file_takes_effect_without_a_restart(secure: Secure) -> None:
    router = secure.cluster.router.popen
    request = user_request(PROMPT, max_tokens=2)
    write_keys(secure.keys_file, {**KEYS, "alpha": "key-alpha-rotated"})
    try:
        with secure.client("alpha") as old:
            refused(lambda: old.count(request), grpc.StatusCode.UNAUTHENTICATED)
        credentials = grpc.ssl_channel_credentials(secure.ca.cert_file.read_bytes())
        with Client(secure.cluster.address, credentials, "key-alpha-rotated") as new:
            assert new.count(request).prompt_tokens > 0
    finally:
        write_keys(secure.keys_file, KEYS)
    with secure.client("alpha") as old:
        assert old.count(request).prompt_tokens > 0
    assert router.poll() is None, "the router restarted"


# Tenants share no prefix blocks and, by default, no embeddings -----------------------


def encoded(secure: Secure) -> float:
    return secure.metric(secure.cluster.encoders[0], "epd_encoder_items_encoded_total")


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_second_tenant_gets_no_cached_tokens_and_is_encoded_again(secure: Secure) -> None:
    request = user_request(PROMPT, [media_factory.png(96, 64, seed=41)], max_tokens=4)
    start = encoded(secure)
    generate(secure.client("gamma"), request)
    wait_for(lambda: encoded(secure) == start + 1, "gamma's image to be encoded")
    again = generate(secure.client("gamma"), request)
    assert again.usage.cached_tokens > 0, "the same tenant should hit its own prefix cache"
    other = generate(secure.client("delta"), request)
    assert other.usage.cached_tokens == 0
    wait_for(lambda: encoded(secure) == start + 2, "delta's copy of the image to be encoded again")
    assert other.usage.prompt_tokens == again.usage.prompt_tokens


@contextmanager
def sharing_router(secure: Secure) -> Iterator[Process]:
    """A second router on the same cluster with EPD_SHARE_EMBEDDINGS_ACROSS_TENANTS=true."""
    env = {**secure.cluster.router.env, "EPD_SHARE_EMBEDDINGS_ACROSS_TENANTS": "true", "EPD_HTTP_PORT": "0"}
    router = spawn("router", free_port(), free_port(), env, secure.folder / "logs")
    try:
        deadline = time.monotonic() + 120
        while not check(router.address, tls=secure.internal()):
            assert router.popen.poll() is None, router.log_tail()
            assert time.monotonic() < deadline, router.log_tail()
            time.sleep(0.2)
        yield router
    finally:
        router.popen.terminate()
        router.popen.wait(timeout=30)


def test_shared_embeddings_are_encoded_once_but_prefix_blocks_stay_per_tenant(secure: Secure) -> None:
    request = user_request(PROMPT, [media_factory.png(64, 96, seed=42)], max_tokens=4)
    with sharing_router(secure) as router:
        start = encoded(secure)
        generate(secure.client("epsilon", router.address), request)
        wait_for(lambda: encoded(secure) == start + 1, "the image to be encoded")
        other = generate(secure.client("zeta", router.address), request)
        assert other.usage.cached_tokens == 0, "prefix blocks must never be shared across tenants"
        assert encoded(secure) == start + 1, "with sharing on, the second tenant's image must come from the cache"
        assert secure.router_metric("epd_embedding_cache_hits_total", router=router) >= 1
        again = generate(secure.client("epsilon", router.address), request)
        assert again.usage.cached_tokens > 0


# Per-tenant limits -----------------------------------------------------------------------------------


def test_a_tenant_over_its_limits_is_refused_while_others_are_served(secure: Secure) -> None:
    small = secure.client("small")
    running = small.stream(endless("Count slowly, one number per line.", SMALL_TPM - 100), timeout_s=120)
    next(iter(running))
    try:
        with secure.client("small") as second:
            error = refused(
                lambda: second.generate(user_request("hi", max_tokens=2)), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
        assert int(dict(error.trailing_metadata())["retry-after-ms"]) > 0
        assert "in flight" in error.details()
        with secure.https(KEYS["small"]) as http:
            answer = http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
            )
        assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1, answer.text
        assert generate(secure.client("beta"), user_request("hi", max_tokens=2)).usage.completion_tokens == 2
    finally:
        running.cancel()
        small.close()
    # the first request projected nearly all of the tenant's SMALL_TPM tokens: the next needs about a minute
    big = endless("hi", max_tokens=SMALL_TPM - 100)
    deadline = time.monotonic() + 10
    while True:
        with secure.client("small") as third:
            error = refused(lambda: third.generate(big), grpc.StatusCode.RESOURCE_EXHAUSTED)
        if "in flight" not in error.details() or time.monotonic() > deadline:
            break  # the cancelled request's slot is released a moment after the cancel
        time.sleep(0.1)
    assert "per minute" in error.details(), error.details()
    assert int(dict(error.trailing_metadata())["retry-after-ms"]) > 0
    assert generate(secure.client("beta"), user_request("hello", max_tokens=2)).usage.completion_tokens == 2
    for reason in ("tenant_concurrency", "tenant_tokens"):
        labels = (f'reason="{reason}"', 'tenant="small"')
        assert secure.router_metric("epd_admission_rejections_total", *labels) >= 1
    assert secure.router_metric("epd_requests_total", 'tenant="beta"', 'outcome="ok"') >= 2
