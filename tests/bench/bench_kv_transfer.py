"""Benchmark: KV transfer MB/s per transport against a plain memory copy of the same bytes, measured in one run.

One real decode worker (`EPD_WORKER_ROLE=decode`, its own process, a private Redis) of the model folder given
or made (`make_tiny_model`, `--text-width` 512 x `--text-layers` 8 by default, 2 KV heads: 16 KiB of KV
per prompt token in float32); the blocks' shape, dtype and block size are the ones it publishes in its KV
layout identity. This process plays the prefill worker: each round pushes `--requests` prompts of
`--prompt-tokens` tokens, `--chunk-tokens` per chunk, each request on its own `Worker.PushKV` stream, all at once,
by each KV transport (services/worker/kv_transfer.py): `grpc` (~1 MiB messages, the decode worker rebuilds every
chunk on its event loop) and `gloo` (`EPD_KV_TRANSPORT=dist`: one message per chunk, the bytes over the one
torch.distributed pair this process keeps with the worker, received on the pair's thread). The decode worker
hands every chunk to its engine thread, which drops it, since no request there is receiving it: a measurement of
the transfer itself, not of a prefill. The time runs from the first message to the last acknowledgement. The
baseline copies the same tensors in memory (`torch.Tensor.clone`) in this process. The transports alternate
which goes first each round. Printed: per transport MB/s p50 over `--rounds` rounds (the first is a warm-up, not
counted: it makes the gloo pair) and its ratio to the copy's, then one JSON line.
Run: `epd bench kv-transfer [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MB = 1e6


def _chunks(layout: dict, tokens: int, chunk_tokens: int, request_id: str) -> list:
    """One prompt's KV as the chunks a prefill worker sends (every layer's keys and values of the blocks)."""
    from services.worker.engine.kv_connector import FirstToken, KVChunk

    size = int(layout["block_size"])
    dtype = getattr(torch, str(layout["dtype"]).removeprefix("torch."))
    shape = (int(layout["num_layers"]), int(layout["kv_heads"]), int(layout["head_dim"]))
    out = []
    for start in range(0, tokens, chunk_tokens):
        end = min(tokens, start + chunk_tokens)
        first, blocks = start // size, -(-end // size) - start // size
        keys = torch.randn(shape[0], blocks, size, shape[1], shape[2]).to(dtype)
        values = torch.randn_like(keys)
        last = FirstToken(1, None, 0) if end == tokens else None
        out.append(KVChunk(request_id, first, end, keys, values, last))
    return out


async def _push_all(stub: Any, address: str, requests: list[list], timeout_s: float, transport: Any) -> float:
    """Every request's chunks on its own PushKV stream by ``transport``, all at once; seconds to the last
    acknowledgement."""
    from services.worker.kv_transfer import KVPusher

    start = time.perf_counter()
    pushers = [KVPusher(stub, timeout_s, transport, address) for _ in requests]
    for pusher, chunks in zip(pushers, requests, strict=True):
        for chunk in chunks:
            pusher.put(chunk)
        pusher.close()
    acks = await asyncio.gather(*(p.ack() for p in pushers))
    seconds = time.perf_counter() - start
    sent = sum(c.nbytes for chunks in requests for c in chunks)
    received = sum(a.bytes for a in acks)
    if received != sent:
        raise RuntimeError(f"the decode worker acknowledged {received} bytes of {sent} ({transport.name})")
    return seconds


async def _rounds(address: str, layout: dict, args: argparse.Namespace) -> tuple[list[dict[str, float]], int]:
    """Each round's MB/s per transport and for the copy; the bytes a round moves."""
    import grpc

    from services.common.grpc_server import channel_options
    from services.common.rpc.epd.v1 import worker_pb2_grpc
    from services.worker.kv_transfer import kv_transport

    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        transports = {"grpc": kv_transport("grpc", lambda _: stub, "127.0.0.1", 300.0)}
        transports["gloo"] = kv_transport("dist", lambda _: stub, "127.0.0.1", 300.0)
        rounds = []
        try:
            for k in range(args.rounds):
                requests = [
                    _chunks(layout, args.prompt_tokens, args.chunk_tokens, f"bench-{k}-{i}")
                    for i in range(args.requests)
                ]
                nbytes = sum(c.nbytes for chunks in requests for c in chunks)
                figures = {"copy": nbytes / _copy_seconds(requests) / MB}
                for name in sorted(transports, reverse=k % 2 == 1):
                    figures[name] = nbytes / await _push_all(stub, address, requests, 300.0, transports[name]) / MB
                rounds.append(figures)
            if transports["gloo"].inline_chunks:
                raise RuntimeError(f"{transports['gloo'].inline_chunks} chunks went inline: no gloo pair was made")
        finally:
            for transport in transports.values():
                transport.close()
    return rounds, nbytes


def _copy_seconds(requests: list[list]) -> float:
    start = time.perf_counter()
    for chunks in requests:
        for chunk in chunks:
            chunk.keys.clone()
            chunk.values.clone()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="epd bench kv-transfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: a tiny one made for the run)")
    parser.add_argument("--text-width", type=int, default=512, help="the made model's hidden size")
    parser.add_argument("--text-layers", type=int, default=8, help="the made model's layers")
    parser.add_argument("--requests", type=int, default=8, help="prompts pushed at once per round")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (a prefill step's)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (the first is a warm-up)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model, 2 prompts, 3 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.text_width, args.text_layers, args.requests, args.prompt_tokens, args.rounds = 128, 2, 2, 256, 3
        args.chunk_tokens = 64

    from services.common.registry import Registry
    from services.launch import local
    from services.launch.health import wait_healthy
    from services.models.tiny_model import make_tiny_model
    from tests.redis_server import RedisServer

    redis = RedisServer(local.free_port())
    redis.start()
    worker = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = (
                Path(args.model)
                if args.model
                else make_tiny_model(
                    Path(tmp) / "model", "qwen2-vl", text_width=args.text_width, text_layers=args.text_layers
                )
            )
            env = {
                "EPD_MODEL": str(model),
                "EPD_REDIS_URL": redis.url,
                "EPD_WORKER_ROLE": "decode",
                "EPD_TORCH_THREADS": "1",
            }
            worker = local.spawn("worker", local.free_port(), 0, env, Path(tmp))
            wait_healthy(worker.address, 300, lambda: worker.popen.poll() is None)
            registry = Registry(redis.url)
            deadline = time.monotonic() + 30
            while not (members := registry.members("worker") or []) and time.monotonic() < deadline:
                time.sleep(0.1)
            registry.close()
            layout = members[0].state["kv_layout"]
            rounds, nbytes = asyncio.run(_rounds(worker.address, layout, args))
    finally:
        if worker is not None:
            worker.popen.terminate()
            worker.popen.wait(30)
        redis.stop()
    counted = rounds[1:] or rounds
    medians = {name: statistics.median(r[name] for r in counted) for name in ("copy", "grpc", "gloo")}
    copy_mb_s = medians["copy"]
    per_token = nbytes / (args.requests * args.prompt_tokens)
    print(
        f"KV layout {layout['num_layers']} layers x {layout['kv_heads']} KV heads x {layout['head_dim']} "
        f"({layout['dtype']}, {layout['block_size']}-token blocks, {layout['layout']}): {per_token / 1024:.1f} KiB "
        f"per token; {args.requests} prompts of {args.prompt_tokens} tokens a round ({nbytes / MB:.1f} MB) in "
        f"{args.chunk_tokens}-token chunks, {len(counted)} rounds counted; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"memory copy  {copy_mb_s:9.1f} MB/s")
    for name in ("grpc", "gloo"):
        print(f"{name:<12} {medians[name]:9.1f} MB/s  ({medians[name] / copy_mb_s:.3f} x the copy)")
    report = {
        "bytes_per_round": nbytes,
        "kib_per_token": per_token / 1024,
        "memcpy_mb_s": copy_mb_s,
        "transports": {
            name: {"mb_s": medians[name], "ratio_to_memcpy": medians[name] / copy_mb_s} for name in ("grpc", "gloo")
        },
        "rounds_mb_s": [{name: round(value, 1) for name, value in r.items()} for r in rounds],
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
