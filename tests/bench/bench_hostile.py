"""Benchmark: hostile structured-output constraints' refusal times against a valid request's latency, same run.

    epd bench hostile [--repeats 10] [--model DIR]

A real local cluster (router, encoder, worker, a private Redis; free ports; the tiny model by default) gets,
each `--repeats` times after one untimed try, a 10 MB JSON schema, a 10,000-deep nesting (as an HTTP body
nested past the JSON parser's limit, and as a gRPC `json_schema` string, which reaches the router's depth
check), a catastrophic regex (`(x*x*)*y`), a schema with an unknown string format, and, as the baseline, a
plain request (one token) and a valid constrained one (a choice, compiled once before the clock). Each
refusal must be a 400 / INVALID_ARGUMENT whose message names the problem. Prints, per case, the median and
the slowest time from sending to the answer (the client's time: the body's upload included), its ratio to
the plain request's median, and whether it is under the 100 ms target; then whether anything was admitted
or reserved while the hostile cases ran (the router's admissions, `epd_request_queue_time_seconds_count`;
the worker's `epd_prompt_tokens_total` and `epd_kv_cache_reserved_blocks`), the load average, and one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import common_pb2, generation_pb2, generation_pb2_grpc

TARGET_MS = 100.0
MESSAGES = [{"role": "user", "content": "Say something about cats."}]
DEEP = 10_000


@dataclass(frozen=True)
class Case:
    """One request: sent by ``send`` (returns the status and the error message, "" when it was served);
    ``said``: what a refusal's message must contain ("" for a request that must be served)."""

    name: str
    send: Callable[[], tuple[str, str]]
    said: str = ""


def _http(client: httpx.Client, body: bytes) -> tuple[str, str]:
    response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    if response.status_code == 200:
        return "200", ""
    return str(response.status_code), str(response.json().get("error", {}).get("message", response.text))


def _grpc(stub: Any, sampling: common_pb2.SamplingParams) -> tuple[str, str]:
    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.Message(role="user", content=[generation_pb2.ContentPart(text="x")])],
        sampling=sampling,
    )
    try:
        for _ in stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


def cases(client: httpx.Client, stub: Any) -> tuple[list[Case], list[Case]]:
    """The baseline requests and the hostile ones."""

    def http(extra: dict[str, Any]) -> Callable[[], tuple[str, str]]:
        body = json.dumps({"messages": MESSAGES, **extra}).encode()
        return functools.partial(_http, client, body)

    huge = {"type": "object", "description": "x" * 10_000_000}
    deep_body = (
        '{"messages": [{"role": "user", "content": "x"}], "guided_json": ' + "[" * DEEP + "]" * DEEP + "}"
    ).encode()
    deep_schema = '{"items":' * DEEP + "{}" + "}" * DEEP  # 100 kB: under the size limit, past the depth limit
    baseline = [
        Case("plain request (1 token)", http({"max_tokens": 1})),
        Case("valid choice (2 tokens)", http({"max_tokens": 2, "guided_choice": ["a", "b"]})),
    ]
    hostile = [
        Case(
            "10 MB schema (HTTP)",
            http({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}}),
            "above this server's limit",
        ),
        Case(
            f"{DEEP:,}-deep JSON body (HTTP)",
            functools.partial(_http, client, deep_body),
            "nested too deeply",
        ),
        Case(
            f"{DEEP:,}-deep schema (gRPC)",
            functools.partial(_grpc, stub, common_pb2.SamplingParams(max_tokens=4, json_schema=deep_schema)),
            "nested deeper than this server's limit",
        ),
        Case(
            "catastrophic regex (HTTP)",
            http({"structured_outputs": {"regex": "(x*x*)*y"}}),
            "repeats a group that repeats without bound",
        ),
        Case(
            "unknown format (HTTP)",
            http({"guided_json": {"type": "string", "format": "credit-card"}}),
            "format 'credit-card' is not supported",
        ),
    ]
    return baseline, hostile


def timed(case: Case, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` tries after an untimed one; AssertionError when an answer is not
    what the case expects."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        status, message = case.send()
        elapsed = (time.perf_counter() - start) * 1000
        if case.said:
            assert status in ("400", "INVALID_ARGUMENT") and case.said in message, (case.name, status, message)
        else:
            assert status in ("200", "OK"), (case.name, status, message)
        if i:
            times.append(elapsed)
    return times


def metric(port: int, name: str) -> float:
    """Sum of the samples of ``name`` on a service's Prometheus endpoint."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and line[len(name)] in "{ "
    )


def main(argv: list[str] | None = None) -> int:
    """`epd bench hostile`: start a cluster, time the cases, print them; exit status 0."""
    parser = argparse.ArgumentParser(prog="epd bench hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: a tiny random Qwen2-VL built offline)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    from services.launch.local import ClusterSpec, free_port, start_cluster
    from services.models.tiny_model import make_tiny_model
    from tests.redis_server import RedisServer

    redis = RedisServer(free_port())
    redis.start()
    try:
        with tempfile.TemporaryDirectory(prefix="epd-bench-hostile-") as tmp:
            model = args.model or make_tiny_model(Path(tmp) / "model", "qwen2-vl")
            spec = ClusterSpec(
                model, redis_url=redis.url, free_ports=True, env={"EPD_HTTP_PORT": str(free_port())},
                log_dir=Path(tmp) / "logs",
            )  # fmt: skip
            cluster = start_cluster(spec)
            try:
                result = measure(cluster, args.repeats)
            finally:
                cluster.stop()
    finally:
        redis.stop()
    print(json.dumps(result))
    return 0


def measure(cluster: Any, repeats: int) -> dict[str, Any]:
    """Time every case on ``cluster`` (a ``LocalCluster``), print the table, return the summary."""
    router, worker = cluster.router.metrics_port, cluster.workers[0].metrics_port
    with (
        httpx.Client(base_url=cluster.http_url, timeout=60) as client,
        grpc.insecure_channel(cluster.address, options=channel_options()) as channel,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        baseline, hostile = cases(client, stub)
        base = {case.name: timed(case, repeats) for case in baseline}
        before = (metric(router, "epd_request_queue_time_seconds_count"), metric(worker, "epd_prompt_tokens_total"))
        refusals = {case.name: timed(case, repeats) for case in hostile}
        after = (metric(router, "epd_request_queue_time_seconds_count"), metric(worker, "epd_prompt_tokens_total"))
        reserved = metric(worker, "epd_kv_cache_reserved_blocks")
    plain = statistics.median(base[baseline[0].name])
    print(f"{repeats} timed tries per case after one untimed; client time from sending to the whole answer")
    print(f"{'case':<32} {'median ms':>10} {'max ms':>8} {'x plain':>8}  target < {TARGET_MS:g} ms")
    rows = {}
    for name, times in {**base, **refusals}.items():
        median, worst = statistics.median(times), max(times)
        met = "" if name in base else ("met" if worst < TARGET_MS else "NOT met")
        print(f"{name:<32} {median:10.2f} {worst:8.2f} {median / plain:8.2f}  {met}")
        rows[name] = {"median_ms": round(median, 2), "max_ms": round(worst, 2), "x_plain": round(median / plain, 3)}
    admitted, prompt_tokens = after[0] - before[0], after[1] - before[1]
    print(
        f"while the hostile cases ran: {admitted:g} admissions at the router, {prompt_tokens:g} prompt tokens at "
        f"the worker; {reserved:g} KV blocks reserved after them"
    )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return {
        "cases": rows,
        "all_under_target": all(max(t) < TARGET_MS for t in refusals.values()),
        "admitted_while_hostile": admitted,
        "prompt_tokens_while_hostile": prompt_tokens,
        "reserved_blocks_after": reserved,
        "load_average": [round(x, 2) for x in load],
    }


if __name__ == "__main__":
    raise SystemExit(main())
