"""The torch.distributed (gloo) KV transport between a prefill worker and a decode worker.

The prefill side is `KVPusher` with `DistKV` (services/worker/kv_transfer.py); the decode side the real
`WorkerServicer.PushKV` / `DistConnect` handlers over a stand-in engine host (tests/kv_dist_support.py), served on
127.0.0.1: in this process (the two ranks on their own pair threads) or, for a peer killed mid-transfer, in a
process of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from services.common.dist_receiver import DistReceiver
from services.common.dist_sender import SenderPairs
from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.common.transport_dist import DistError
from services.worker.engine.kv_connector import FirstToken, KVChunk
from services.worker.engine.request import TokenLogprobs
from services.worker.kv_transfer import DistKV, KVPusher, is_failure, kv_transport
from tests.bench.receiver import digest
from tests.kv_dist_support import LOCAL, ChunkHost, serve, servicer

ROOT = Path(__file__).resolve().parents[2]


def _chunks(request_id: str, dtype: torch.dtype, seed: int) -> list[KVChunk]:
    """A prompt's KV as three chunks (4 layers, 2 KV heads, 16-token blocks, head dim 8): 3 blocks, 2 blocks, then
    the first token alone (no blocks) with its logprobs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for first_block, blocks in ((0, 3), (3, 2)):
        keys = torch.randn(4, blocks, 16, 2, 8, generator=gen).to(dtype)
        values = torch.randn(4, blocks, 16, 2, 8, generator=gen).to(dtype)
        keys.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]).to(dtype)  # odd bit patterns
        out.append(KVChunk(request_id, first_block, (first_block + blocks) * 16, keys, values))
    empty = torch.empty(4, 0, 16, 2, 8, dtype=dtype)
    first = FirstToken(42, TokenLogprobs(-0.25, (42, 7), (-0.25, -1.5)), -3)
    out.append(KVChunk(request_id, 5, 80, empty, empty.clone(), first))
    return out


def _pairs(timeout_s: float) -> SenderPairs:
    return SenderPairs(
        lambda address: worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address)), "gloo", "127.0.0.1", timeout_s
    )


async def _push(
    address: str, transport: DistKV, chunks: list[KVChunk], timeout_s: float = 20.0, carried: dict | None = None
) -> int:
    """The bytes the decode side acknowledged; ``carried`` gets the pusher's bytes by the transport that sent them."""
    stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address))
    pusher = KVPusher(stub, timeout_s, transport, address)
    for chunk in chunks:
        pusher.put(chunk)
    pusher.close()
    acked = int((await pusher.ack()).bytes)
    if carried is not None:
        carried.update(pusher.bytes)
    return acked


def test_kv_chunks_round_trip_bit_identical_over_one_gloo_pair() -> None:
    host = ChunkHost()
    sent = {"f32": _chunks("f32", torch.float32, 0), "bf16": _chunks("bf16", torch.bfloat16, 1)}

    async def go() -> list[int]:
        service = servicer(host)
        running = await serve(service)
        address = f"127.0.0.1:{running.port}"
        transport = DistKV(_pairs(20.0))
        try:
            carried: list[dict[str, int]] = [{} for _ in sent]
            pairs = zip(sent.values(), carried, strict=True)
            pushes = (_push(address, transport, chunks, carried=c) for chunks, c in pairs)
            acked = await asyncio.gather(*pushes)
            pair = transport.pairs.current(address)
            assert pair is not None and not pair.closed  # both requests' chunks went on one pair, kept for the next
            assert transport.inline_chunks == 0
            assert carried == [{"dist": n} for n in acked]
            totals = service._metrics.kv_transfer_bytes.totals
            assert totals[(("direction", "received"), ("transport", "dist"))] == sum(acked)
            assert totals.get((("direction", "received"), ("transport", "grpc")), 0) == 0  # no byte came by gRPC
            return acked
        finally:
            transport.close()
            service.close()
            await running.stop(0.1)

    acked = asyncio.run(go())
    for name, chunks in sent.items():
        got = [c for c in host.chunks if c.request_id == name]
        assert len(got) == len(chunks)
        for want, have in zip(chunks, got, strict=True):
            assert (have.first_block, have.num_tokens, have.first_token) == (
                want.first_block,
                want.num_tokens,
                want.first_token,
            )
            for a, b in ((want.keys, have.keys), (want.values, have.values)):
                assert b.dtype == a.dtype and b.shape == a.shape and digest(b) == digest(a)
            if have.keys.numel():  # received into one buffer per chunk: keys and values are views of it
                assert have.keys.untyped_storage().data_ptr() == have.values.untyped_storage().data_ptr()
    assert acked == [sum(c.nbytes for c in chunks) for chunks in sent.values()]


class NeverJoins(DistReceiver):
    """A decode worker that answers DistConnect with its store's address and never joins the pair as rank 0."""

    def connect(self, request: worker_pb2.DistConnectRequest) -> worker_pb2.DistConnectReply:
        with self._lock:
            store = self._store_locked(request.timeout_s or 30.0)
        return worker_pb2.DistConnectReply(store_addr=f"127.0.0.1:{store.port}")


def test_a_receiver_that_never_joins_fails_the_pair_set_up_clearly() -> None:
    async def go() -> None:
        service = servicer(ChunkHost(), NeverJoins(LOCAL))
        running = await serve(service)
        pairs = _pairs(1.0)
        try:
            with pytest.raises(DistError, match="set-up"):
                await asyncio.wait_for(pairs.pair(f"127.0.0.1:{running.port}", 1.0), 60)  # only a hang reaches 60
        finally:
            pairs.close()
            service.close()
            await running.stop(0.1)

    asyncio.run(go())


def test_a_pair_that_cannot_be_made_sends_inline_and_delivers() -> None:
    """The chunk whose pair set-up failed goes inline over gRPC and arrives all the same; the peer is not tried
    again at once, so the rest go inline too without a wait."""
    host = ChunkHost()
    chunks = _chunks("r", torch.float32, 2)

    async def go() -> int:
        service = servicer(host, NeverJoins(LOCAL))
        running = await serve(service)
        address = f"127.0.0.1:{running.port}"
        transport = DistKV(_pairs(1.0))
        try:
            carried: dict[str, int] = {}
            acked = await asyncio.wait_for(_push(address, transport, chunks, carried=carried), 60)
            assert transport.inline_chunks == len(chunks) and transport.pairs.current(address) is None
            assert carried == {"grpc": acked}  # counted as the transport that carried them, not the configured one
            return acked
        finally:
            transport.close()
            service.close()
            await running.stop(0.1)

    assert asyncio.run(go()) == sum(c.nbytes for c in chunks)
    assert [(digest(c.keys), digest(c.values)) for c in host.chunks] == [
        (digest(c.keys), digest(c.values)) for c in chunks
    ]
    assert host.chunks[-1].first_token == chunks[-1].first_token


def test_a_peer_killed_mid_transfer_fails_the_push_and_drops_the_pair() -> None:
    """The decode worker (its own process) takes a chunk's control message and is killed before it receives the
    bytes: the push ends with a failure the prefill worker's fallback handles, within the pair's timeout, and the
    pair is dropped (the next push makes a new one)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.kv_dist_support", "stall"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        address = f"127.0.0.1:{child.stdout.readline().strip()}"

        async def go() -> BaseException:
            transport = DistKV(_pairs(20.0))
            task = asyncio.create_task(_push(address, transport, _chunks("k", torch.float32, 3)))
            line = await asyncio.to_thread(child.stdout.readline)
            assert line.strip() == "stalled"
            child.send_signal(signal.SIGKILL)
            try:
                with pytest.raises(Exception) as info:
                    await asyncio.wait_for(task, 60)  # the pair's timeout is 20 s: only a hang reaches 60
                assert transport.pairs.current(address) is None
                return info.value
            finally:
                transport.close()

        error = asyncio.run(go())
        assert is_failure(error), repr(error)
    finally:
        child.kill()
        child.wait()


def test_the_setting_names_the_transport() -> None:
    stub = lambda address: None  # noqa: E731
    assert kv_transport("grpc", stub, "127.0.0.1", 5).name == "grpc"
    dist = kv_transport("dist", stub, "127.0.0.1", 5)
    assert isinstance(dist, DistKV) and dist.pairs.backend == "gloo"
    with pytest.raises(ValueError):
        kv_transport("shm", stub, "127.0.0.1", 5)
