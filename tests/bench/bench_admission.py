"""Admission under overload: twice the KV the workers hold, against half of it, same run.

Two workers with 64 KV blocks each; every request projects ~23 blocks, so the cluster holds four
at once. Closed-loop clients keep sending: 2 clients is half the KV, 8 clients offer twice it
(refused clients wait the server's retry-after-ms hint, then retry). Prints latency percentiles of
admitted requests (and their time to first token) and of refusals, and as its last line one JSON object:
`admitted_p99_ratio` (2x load over half load; target <= 1.5) and `refusal_p99_ms` (target < 20), and the
workers' KV states sampled from the registry every 0.1 s (most blocks reserved and in use against capacity,
preemptions).

The model is make_tiny_model's, 256 wide and 8 layers deep by default (`--text-width`, `--text-layers`):
its decode step (~4-5 ms here) costs about the same for one sequence or two, as a GPU's does, and more than
streaming a token. The default 64-wide 2-layer model steps in ~1 ms, no more than relaying one token
through two gRPC hops, so twice the running requests cost this box twice the CPU per token whatever
admission does. Everything shares this box's cores: the workers' engine threads run at nice 10
(`EPD_COMPUTE_NICE`), standing in for the router having CPUs of its own, and the clients are tasks of
one asyncio process (one channel each), not a process per client competing for the two cores.
Run: `epd bench admission [--seconds S]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.client import user_request
from services.common.grpc_server import channel_options
from services.common.registry import Registry
from services.common.rpc.epd.v1 import generation_pb2_grpc
from tests.kv_sampler import KVSampler

PROMPT = " ".join(["describe the bright window near the small table"] * 10)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Outcomes:
    """Seconds: admitted requests' end to end and to the first response; refusals'; slow refusals' messages."""

    admitted: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)
    kv: dict[str, int] = field(default_factory=dict)  # KVSampler.peaks() over the level


async def _client(address: str, index: int, stop_at: float, max_tokens: int, out: _Outcomes) -> None:
    """One closed-loop client on its own connection, starting 50 ms after the previous one: the load is
    steady overload, not one synchronized burst (that case is tests/integration/test_admission.py's)."""
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await channel.channel_ready()  # a connection handshake is not part of a refusal's latency
        stub = generation_pb2_grpc.GenerationStub(channel)
        await asyncio.sleep(0.05 * index)
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            request = user_request(f"{index}-{n} {PROMPT}", max_tokens=max_tokens)
            request.sampling.ignore_eos = True
            start = time.perf_counter()
            try:
                first = None
                async for _ in stub.Generate(request, timeout=120):
                    first = first or time.perf_counter() - start
                out.admitted.append(time.perf_counter() - start)
                out.first_token.append(first or float("nan"))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                out.refused.append(time.perf_counter() - start)
                if out.refused[-1] > 0.02:
                    out.slow.append(exc.details() or "")
                hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "500")
                await asyncio.sleep(int(hint) / 1000)


def _run(address: str, clients: int, seconds: float, max_tokens: int, registry: Registry) -> _Outcomes:
    out = _Outcomes()

    async def load() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_client(address, i, stop_at, max_tokens, out) for i in range(clients)))

    with KVSampler(registry, interval_s=0.1) as sampler:
        asyncio.run(load())
    out.kv = sampler.peaks()
    if out.slow:
        kinds: dict[str, int] = {}
        for text in out.slow:
            queued = "within" in text or "after waiting" in text
            key = "queued" if queued else "at once" if "unreserved" in text else text
            kinds[key] = kinds.get(key, 0) + 1
        print(f"refusals over 20 ms with {clients} clients, by kind: {kinds}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="epd bench admission", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="per load level (a p99 needs hundreds of refusals)")
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--text-width", type=int, default=256, help="the model's hidden size (multiple of 64)")
    parser.add_argument("--text-layers", type=int, default=8, help="the model's layers")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoConfig

    from services.launch.local import ClusterSpec, free_port, start_cluster
    from services.models.tiny_model import make_tiny_model
    from services.worker.engine.attention import DEFAULT_BLOCK_SIZE
    from services.worker.engine.attention.kv_cache import KVShape
    from tests.integration.conftest import RedisServer

    redis = RedisServer(free_port())
    redis.start()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp) / "model", "qwen2-vl", text_width=args.text_width, text_layers=args.text_layers
        )
        shape = KVShape.of_config(AutoConfig.from_pretrained(model))
        block_bytes = shape.block_bytes(DEFAULT_BLOCK_SIZE, torch.float32)  # CPU workers' default block size
        env = {
            "EPD_KV_CACHE_BYTES": str(64 * block_bytes),
            "EPD_COMPUTE_NICE": os.environ.get("EPD_COMPUTE_NICE", "10"),
        }
        cluster = start_cluster(ClusterSpec(model, workers=2, redis_url=redis.url, free_ports=True, env=env))
        try:
            registry = Registry(redis.url)
            half = _run(cluster.address, 2, args.seconds, args.max_tokens, registry)
            double = _run(cluster.address, 8, args.seconds, args.max_tokens, registry)
        finally:
            cluster.stop()
            redis.stop()
    for name, data in (("half", half), ("double", double)):
        a, f, r = data.admitted, data.first_token, data.refused
        print(
            f"{name:6s} admitted {len(a):4d}  p50 {_percentile(a, 0.5):6.3f}s  p99 {_percentile(a, 0.99):6.3f}s  "
            f"first token p50 {1000 * _percentile(f, 0.5):6.1f}ms  p99 {1000 * _percentile(f, 0.99):6.1f}ms   "
            f"refused {len(r):4d}  p50 {1000 * _percentile(r, 0.5):6.1f}ms  p99 {1000 * _percentile(r, 0.99):6.1f}ms"
        )
        kv = data.kv
        print(
            f"{name:6s} KV sampled {kv.get('samples', 0)} times: most reserved {kv.get('max_reserved_blocks')} and "
            f"in use {kv.get('max_used_blocks')} of {kv.get('capacity_blocks')} blocks per worker, "
            f"preemptions {kv.get('preemptions')}"
        )
    result = {
        "half_admitted_p99_s": _percentile(half.admitted, 0.99),
        "double_admitted_p99_s": _percentile(double.admitted, 0.99),
        "admitted_p99_ratio": _percentile(double.admitted, 0.99) / _percentile(half.admitted, 0.99),
        "refusal_p50_ms": 1000 * _percentile(double.refused, 0.5),
        "refusal_p99_ms": 1000 * _percentile(double.refused, 0.99),
        "double_throughput_rps": len(double.admitted) / args.seconds,
        "half_throughput_rps": len(half.admitted) / args.seconds,
        "median_admitted_s": statistics.median(double.admitted) if double.admitted else None,
        "double_max_reserved_blocks": double.kv.get("max_reserved_blocks"),
        "double_max_used_blocks": double.kv.get("max_used_blocks"),
        "capacity_blocks": double.kv.get("capacity_blocks"),
        "preemptions": double.kv.get("preemptions"),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
