"""Admission under overload (issue 5): twice the KV the workers hold, against half of it, same run.

Two workers with 64 KV blocks each; every request projects ~23 blocks, so the cluster holds four
at once. Closed-loop clients keep sending: 2 clients is half the KV, 8 clients offer twice it
(refused clients wait the server's retry-after-ms hint, then retry). Prints latency percentiles
of admitted requests and of refusals, and as its last line one JSON object:
`admitted_p99_ratio` (2x load over half load; target <= 1.5) and `refusal_p99_ms` (target < 20).
Run: `epd bench admission [--seconds S]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from services.client import Client, user_request
from services.launch.local import ClusterSpec, free_port, start_cluster
from services.models.tiny_model import make_tiny_model
from tests.integration.conftest import RedisServer

BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4
PROMPT = " ".join(["describe the bright window near the small table"] * 10)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run(address: str, clients: int, seconds: float, max_tokens: int) -> dict[str, list[float]]:
    admitted: list[float] = []
    refused: list[float] = []
    slow: list[str] = []
    stop = time.monotonic() + seconds

    def loop(index: int) -> None:
        with Client(address) as client:
            n = 0
            while time.monotonic() < stop:
                n += 1
                request = user_request(f"{index}-{n} {PROMPT}", max_tokens=max_tokens)
                request.sampling.ignore_eos = True
                start = time.perf_counter()
                try:
                    client.generate(request, timeout_s=120)
                    admitted.append(time.perf_counter() - start)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    refused.append(time.perf_counter() - start)
                    if refused[-1] > 0.02:
                        slow.append(exc.details())
                    hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "500")
                    time.sleep(int(hint) / 1000)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if slow:
        kinds: dict[str, int] = {}
        for text in slow:
            queued = "within" in text or "after waiting" in text
            key = "queued" if queued else "at once" if "unreserved" in text else text
            kinds[key] = kinds.get(key, 0) + 1
        print(f"refusals over 20 ms with {clients} clients, by kind: {kinds}")
    return {"admitted": admitted, "refused": refused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd bench admission", description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="per load level")
    parser.add_argument("--max-tokens", type=int, default=150)
    args = parser.parse_args(argv)
    redis = RedisServer(free_port())
    redis.start()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", "qwen2-vl")
        cluster = start_cluster(ClusterSpec(model, workers=2, redis_url=redis.url, free_ports=True,
                                            env={"EPD_KV_CACHE_BYTES": str(64 * BLOCK_BYTES)}))
        try:
            half = _run(cluster.address, 2, args.seconds, args.max_tokens)
            double = _run(cluster.address, 8, args.seconds, args.max_tokens)
        finally:
            cluster.stop()
            redis.stop()
    rows = {"half": half, "double": double}
    for name, data in rows.items():
        a, r = data["admitted"], data["refused"]
        print(f"{name:6s} admitted {len(a):4d}  p50 {_percentile(a, .5):6.3f}s  p99 {_percentile(a, .99):6.3f}s   "
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
