"""Embedding transports in their own processes (gRPC and gloo, bit for bit) and the encoder bench smoke run."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch


def test_embeddings_arrive_bit_identical_through_grpc_and_gloo() -> None:
    from services.common.transport_grpc import Embedding
    from services.encoder.push import Channels, DistPush, push_grpc
    from tests.bench.receiver import ReceiverProcess, digest

    gen = torch.Generator().manual_seed(7)
    tensors = {
        "fp32": torch.randn(1230, 64, generator=gen),
        "bf16": torch.randn(77, 3584, generator=gen).to(torch.bfloat16),
        "fp16": torch.randn(5, 8, generator=gen).to(torch.float16),
        "20mb": torch.randn(20 * 1024 * 1024 // 4, generator=gen),
    }
    assert tensors["20mb"].nbytes == 20 << 20

    async def push_all(address: str) -> None:
        channels = Channels()
        dist = DistPush(channels, "gloo", "127.0.0.1", timeout_s=60)
        try:
            for name, tensor in tensors.items():
                await push_grpc(channels, address, [Embedding(f"grpc-{name}", tensor)], 60)
            await dist.push(address, [Embedding(f"dist-{name}", t) for name, t in tensors.items()], 60)
        finally:
            dist.close()
            await channels.close()

    with ReceiverProcess() as receiver:
        asyncio.run(push_all(receiver.address))
        for name, tensor in tensors.items():
            want = digest(tensor)
            assert receiver.digest(f"grpc-{name}") == want, name
            assert receiver.digest(f"dist-{name}") == want, name


def test_bench_quick_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.bench.bench_encoder import main

    assert main(["--quick"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    for key in (
        "images_per_s_single",
        "images_per_s_batched",
        "batched_over_single",
        "grpc_1mb_mb_per_s",
        "gloo_1mb_mb_per_s",
        "redis_1mb_mb_per_s",
        "gloo_1mb_item_ms",
        "gloo_over_grpc_1mb",
        "redis_over_grpc_1mb",
    ):
        assert figures[key] > 0, key
