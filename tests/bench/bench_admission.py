"""Admission under overload (issue 5): twice the KV the workers hold, against half of it, same run.

Two workers with 64 KV blocks each; every request projects ~23 blocks, so the cluster holds four
at once. Closed-loop clients (one process each) keep sending: 2 clients is half the KV, 8 clients
offer twice it (refused clients wait the server's retry-after-ms hint, then retry). Prints latency
percentiles of admitted requests and of refusals, and as its last line one JSON object:
`admitted_p99_ratio` (2x load over half load; target <= 1.5) and `refusal_p99_ms` (target < 20).

Placement on this box's CPUs stands in for a deployment where the router has CPUs of its own and the
workers compute on GPUs: with two or more CPUs the workers run on the last one (`EPD_CPUS`) and the
router, the encoder and the clients on the others (`--no-split` shares every CPU among all); the
workers' engine threads run at nice 10 (`EPD_COMPUTE_NICE`) so their own event loops stream promptly.
Without the split, streaming twice the tokens through a router that shares the workers' two cores
slows the engines themselves, which measures the box, not admission.
Run: `epd bench admission [--seconds S]`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from multiprocessing import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import grpc

from services.client import Client, user_request
from services.common.priority import pin_process


def _block_bytes(text_width: int, text_layers: int) -> int:
    """KV bytes of one 16-token block of make_tiny_model's model: K and V, 2 KV heads of width / 4, fp32."""
    return 2 * text_layers * 2 * 16 * (text_width // 4) * 4

PROMPT = " ".join(["describe the bright window near the small table"] * 10)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _client(address: str, index: int, seconds: float, max_tokens: int, results: Queue, ready: Barrier,
            cpus: str) -> None:
    """One closed-loop client (its own process: clients sharing a GIL would time each other's waits).

    Starts sending when every client has started (a process start costs seconds of CPU on imports),
    50 ms after the previous client: the load is steady overload, not one synchronized burst (that case
    is tests/integration/test_admission.py's two-router burst).
    """
    pin_process(cpus)
    admitted: list[float] = []
    first_token: list[float] = []
    refused: list[float] = []
    slow: list[str] = []
    with Client(address) as client:
        client.wait_ready()  # a connection handshake is not part of a refusal's latency
        ready.wait()
        time.sleep(0.05 * index)
        stop = time.monotonic() + seconds
        n = 0
        while time.monotonic() < stop:
            n += 1
            request = user_request(f"{index}-{n} {PROMPT}", max_tokens=max_tokens)
            request.sampling.ignore_eos = True
            start = time.perf_counter()
            try:
                first = None
                for _ in client.stream(request, timeout_s=120):
                    first = first or time.perf_counter() - start
                admitted.append(time.perf_counter() - start)
                first_token.append(first or float("nan"))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                refused.append(time.perf_counter() - start)
                if refused[-1] > 0.02:
                    slow.append(exc.details())
                hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "500")
                time.sleep(int(hint) / 1000)
    results.put((admitted, refused, slow, first_token))


def _run(address: str, clients: int, seconds: float, max_tokens: int, cpus: str) -> dict[str, list[float]]:
    """Admitted requests' latency and time to first token, refusals' latency (seconds), over `seconds` of load."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ready = spawn.Barrier(clients)
    processes = [spawn.Process(target=_client, args=(address, i, seconds, max_tokens, results, ready, cpus))
                 for i in range(clients)]
    for p in processes:
        p.start()
    outcomes = [results.get(timeout=seconds + 300) for _ in processes]
    for p in processes:
        p.join()
    admitted = [x for a, _, _, _ in outcomes for x in a]
    refused = [x for _, r, _, _ in outcomes for x in r]
    slow = [x for _, _, s, _ in outcomes for x in s]
    first_token = [x for _, _, _, f in outcomes for x in f]
    if slow:
        kinds: dict[str, int] = {}
        for text in slow:
            queued = "within" in text or "after waiting" in text
            key = "queued" if queued else "at once" if "unreserved" in text else text
            kinds[key] = kinds.get(key, 0) + 1
        print(f"refusals over 20 ms with {clients} clients, by kind: {kinds}")
    return {"admitted": admitted, "refused": refused, "first_token": first_token}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd bench admission", description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="per load level")
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--no-split", action="store_true", help="every process on every CPU")
    parser.add_argument("--text-width", type=int, default=256, help="the model's hidden size (multiple of 64)")
    parser.add_argument("--text-layers", type=int, default=8, help="the model's layers")
    args = parser.parse_args(argv)
    # here, not at the top: every client process imports this module, and torch would cost each seconds
    from services.launch.local import ClusterSpec, free_port, start_cluster
    from services.models.tiny_model import make_tiny_model
    from tests.integration.conftest import RedisServer

    cpus = sorted(os.sched_getaffinity(0))
    split = not args.no_split and len(cpus) >= 2
    front = ",".join(str(c) for c in cpus[:-1]) if split else ""
    back = str(cpus[-1]) if split else ""
    print(f"workers on CPU {back}, router, encoder and clients on {front}" if split else "no CPU split")
    redis = RedisServer(free_port())
    redis.start()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", "qwen2-vl", text_width=args.text_width,
                                text_layers=args.text_layers)
        kv_bytes = 64 * _block_bytes(args.text_width, args.text_layers)
        cluster = start_cluster(ClusterSpec(model, workers=2, redis_url=redis.url, free_ports=True,
                                            env={"EPD_KV_CACHE_BYTES": str(kv_bytes),
                                                 "EPD_COMPUTE_NICE": "10"},
                                            role_env={"worker": {"EPD_CPUS": back}, "router": {"EPD_CPUS": front},
                                                      "encoder": {"EPD_CPUS": front}}))
        try:
            half = _run(cluster.address, 2, args.seconds, args.max_tokens, front)
            double = _run(cluster.address, 8, args.seconds, args.max_tokens, front)
        finally:
            cluster.stop()
            redis.stop()
    rows = {"half": half, "double": double}
    for name, data in rows.items():
        a, r, f = data["admitted"], data["refused"], data["first_token"]
        print(f"{name:6s} admitted {len(a):4d}  p50 {_percentile(a, .5):6.3f}s  p99 {_percentile(a, .99):6.3f}s  "
              f"first token p50 {1000 * _percentile(f, .5):6.1f}ms  p99 {1000 * _percentile(f, .99):6.1f}ms   "
              f"refused {len(r):4d}  p50 {1000 * _percentile(r, .5):6.1f}ms  p99 {1000 * _percentile(r, .99):6.1f}ms")
    result = {
        "half_admitted_p99_s": _percentile(half["admitted"], .99),
        "double_admitted_p99_s": _percentile(double["admitted"], .99),
        "admitted_p99_ratio": _percentile(double["admitted"], .99) / _percentile(half["admitted"], .99),
        "refusal_p50_ms": 1000 * _percentile(double["refused"], .5),
        "refusal_p99_ms": 1000 * _percentile(double["refused"], .99),
        "double_throughput_rps": len(double["admitted"]) / args.seconds,
        "half_throughput_rps": len(half["admitted"]) / args.seconds,
        "median_admitted_s": statistics.median(double["admitted"]) if double["admitted"] else None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
