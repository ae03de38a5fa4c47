"""torch.distributed (gloo) embedding transport: bit-exact transfer, bounded failures, gRPC fallback.

Both ranks run in this process (the worker side through `DistReceiver`, the encoder side through
`PairChannel` / `DistPush`) over real TCP on 127.0.0.1; the cross-process version is in
tests/integration/test_encoder_pool.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from concurrent.futures import Future

import grpc
import pytest
import torch

from services.common import grpc_server
from services.common.dist_receiver import DistReceiver, ReceiverAddress
from services.common.rpc.epd.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.transport_dist import (
    NCCL_ENVIRONMENT,
    SENDER_RANK,
    DistError,
    PairChannel,
    _wire_bytes,
    as_tensor,
    nccl_environment,
    pair_device,
    prepare_nccl_environment,
    tensor_spec,
)
from services.common.transport_grpc import Embedding
from services.encoder.push import Channels, DistPush, Pusher, PushError, PushResult
from tests.bench.receiver import _Receiver, digest

LOCAL = ReceiverAddress("127.0.0.1", "127.0.0.1")


def _meta(tensor: torch.Tensor) -> common_pb2.TensorMeta:
    return common_pb2.TensorMeta(
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=list(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
    )


def _pair(receiver: DistReceiver, timeout_s: float = 20.0) -> PairChannel:
    pair_id = uuid.uuid4().hex
    reply = receiver.connect(worker_pb2.DistConnectRequest(pair_id=pair_id, backend="gloo", timeout_s=timeout_s))
    host, _, port = reply.store_addr.rpartition(":")
    sender = PairChannel(pair_id, "gloo", SENDER_RANK, timeout_s)
    sender.open(host, int(port), "127.0.0.1").result(timeout=timeout_s + 5)
    return sender


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(37, 64, generator=gen),
        torch.randn(5, 3, 8, generator=gen).to(torch.bfloat16),
        torch.randn(11, 7, generator=gen).to(torch.float16),
        torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),  # odd bit patterns survive too
        torch.empty(0, 64),
        torch.randn(5 << 20, generator=gen),  # 20 MiB of float32
    ]


def test_gloo_pair_moves_every_dtype_bit_identically() -> None:
    receiver = DistReceiver(LOCAL)
    sender = _pair(receiver)
    tensors = _tensors()

    async def go() -> list[Embedding]:
        tags = [sender.next_tag() for _ in tensors]
        request = worker_pb2.DistTransfer(
            pair_id=sender.pair_id,
            timeout_s=20,
            items=[
                worker_pb2.DistItem(mm_hash=f"h{i}", meta=_meta(t), tag=tag)
                for i, (t, tag) in enumerate(zip(tensors, tags, strict=True))
            ],
        )
        sent = asyncio.wrap_future(sender.send(list(zip(tensors, tags, strict=True))))
        received, nbytes = await asyncio.gather(receiver.receive(request), sent)
        assert nbytes == sum(t.numel() * t.element_size() for t in tensors)
        return received

    try:
        received = asyncio.run(go())
        for i, (tensor, embedding) in enumerate(zip(tensors, received, strict=True)):
            assert embedding.mm_hash == f"h{i}"
            assert digest(embedding.tensor) == digest(tensor)
            # received straight into a tensor of its own dtype and shape: no byte buffer behind it, no copy after
            assert embedding.tensor.dtype == tensor.dtype and embedding.tensor.shape == tensor.shape
            assert embedding.tensor._base is None
    finally:
        sender.close()
        receiver.close()


def test_a_stalled_transfer_fails_in_bounded_time_and_drops_the_pair() -> None:
    receiver = DistReceiver(LOCAL)
    sender = _pair(receiver, timeout_s=1.0)
    tensor = torch.ones(4)
    request = worker_pb2.DistTransfer(
        pair_id=sender.pair_id, timeout_s=1.0, items=[worker_pb2.DistItem(mm_hash="never", meta=_meta(tensor), tag=99)]
    )
    try:
        start = time.perf_counter()
        with pytest.raises(DistError, match="timed out|failed"):
            asyncio.run(receiver.receive(request))  # the sender never sends
        assert time.perf_counter() - start < 30  # ended by the 1 s timeout; only a hang misses this
        with pytest.raises(DistError, match="unknown or failed pair"):
            asyncio.run(receiver.receive(request))
    finally:
        sender.close()
        receiver.close()


def test_connect_refuses_bad_requests_and_unavailable_backends() -> None:
    receiver = DistReceiver(LOCAL)
    try:
        with pytest.raises(DistError, match="backend"):
            receiver.connect(worker_pb2.DistConnectRequest(pair_id="a", backend="mpi"))
        with pytest.raises(DistError, match="pair_id"):
            receiver.connect(worker_pb2.DistConnectRequest(backend="gloo"))
        receiver.connect(worker_pb2.DistConnectRequest(pair_id="dup", backend="gloo", timeout_s=0.5))
        with pytest.raises(DistError, match="already exists"):
            receiver.connect(worker_pb2.DistConnectRequest(pair_id="dup", backend="gloo", timeout_s=0.5))
        if not torch.cuda.is_available():
            receiver.connect(worker_pb2.DistConnectRequest(pair_id="gpu", backend="nccl", timeout_s=0.5))
            request = worker_pb2.DistTransfer(pair_id="gpu", timeout_s=2)
            with pytest.raises(DistError, match="nccl|unknown or failed"):
                asyncio.run(receiver.receive(request))
    finally:
        receiver.close()
    with pytest.raises(ValueError, match="EPD_DIST_PORT"):
        DistReceiver(ReceiverAddress("127.0.0.1", "127.0.0.1", port=70000))


def test_as_tensor_checks_size_and_dtype() -> None:
    raw = torch.zeros(16, dtype=torch.uint8)
    assert as_tensor(raw, common_pb2.TensorMeta(dtype="float32", shape=[2, 2], nbytes=16)).shape == (2, 2)
    with pytest.raises(DistError, match="needs 32 bytes"):
        as_tensor(raw, common_pb2.TensorMeta(dtype="float32", shape=[2, 4], nbytes=32))
    with pytest.raises(DistError, match="dtype"):
        as_tensor(raw, common_pb2.TensorMeta(dtype="nonsense", shape=[16], nbytes=16))


class _NoDist(_Receiver):
    """A worker whose dist side is broken: DistConnect always fails."""

    async def DistConnect(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no dist here")


async def _serve(servicer: _Receiver) -> grpc_server.RunningServer:
    binding = grpc_server.ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "epd.v1.Worker")
    return await grpc_server.start_server("127.0.0.1", 0, [binding])


def test_dist_push_reuses_its_pair_and_re_pairs_after_a_failure() -> None:
    async def go() -> None:
        servicer = _Receiver()
        running = await _serve(servicer)
        address = f"127.0.0.1:{running.port}"
        channels = Channels()
        push = DistPush(channels, "gloo", "127.0.0.1", timeout_s=10)
        try:
            first, second = torch.randn(3, 4), torch.randn(200, 64).to(torch.bfloat16)
            assert await push.push(address, [Embedding("a", first)], 10) == first.nbytes
            pair = push.pairs.current(address)
            await push.push(address, [Embedding("b", second)], 10)
            assert push.pairs.current(address) is pair
            servicer.pushes.dist.drop(pair.pair_id)  # the worker lost the pair (restart, failure)
            with pytest.raises(PushError, match=f"dist push to worker {address}"):
                await push.push(address, [Embedding("c", first)], 5)
            await push.push(address, [Embedding("c", first)], 10)  # a new pair
            assert push.pairs.current(address).pair_id != pair.pair_id
            assert digest(servicer.received["a"]) == digest(first)
            assert digest(servicer.received["b"]) == digest(second)
            assert digest(servicer.received["c"]) == digest(first)
        finally:
            push.close()
            await channels.close()
            servicer.pushes.dist.close()
            await running.stop(0.1)

    asyncio.run(go())


def test_pusher_falls_back_to_grpc_and_fails_clearly_when_both_fail() -> None:
    async def go() -> None:
        servicer = _NoDist()
        running = await _serve(servicer)
        address = f"127.0.0.1:{running.port}"
        channels = Channels()
        results: list[PushResult] = []
        pusher = Pusher(
            "dist", DistPush(channels, "gloo", "127.0.0.1", timeout_s=5), channels, on_result=results.append
        )
        try:
            tensor = torch.randn(2 << 20)  # 8 MiB: several gRPC chunks
            result = await pusher.push(address, [Embedding("x", tensor)], 10)
            assert (result.transport, result.fell_back, result.bytes) == ("grpc", True, tensor.nbytes)
            assert results == [result]
            assert digest(servicer.received["x"]) == digest(tensor)
            await running.stop(0.1)
            start = time.perf_counter()
            with pytest.raises(PushError, match=f"worker {address}"):
                await pusher.push(address, [Embedding("y", tensor)], 2)
            assert time.perf_counter() - start < 30  # bounded by the push's own timeouts; only a hang misses this
        finally:
            await pusher.close()
            servicer.pushes.dist.close()

    asyncio.run(go())


# --- failure handling and NCCL settings -------------------------------------------------------------------


def _request(pair: PairChannel, tensor: torch.Tensor, tag: int, timeout_s: float) -> worker_pb2.DistTransfer:
    item = worker_pb2.DistItem(mm_hash=f"item-{tag}", meta=_meta(tensor), tag=tag)
    return worker_pb2.DistTransfer(pair_id=pair.pair_id, timeout_s=timeout_s, items=[item])


def _transfer(receiver: DistReceiver, sender: PairChannel, tensor: torch.Tensor, timeout_s: float = 20) -> torch.Tensor:
    async def go() -> torch.Tensor:
        tag = sender.next_tag()
        sent = asyncio.wrap_future(sender.send([(tensor, tag)]))
        received, _ = await asyncio.gather(receiver.receive(_request(sender, tensor, tag, timeout_s)), sent)
        return received[0].tensor

    return asyncio.run(go())


def test_close_while_the_peer_stalls_returns_at_once_and_the_process_carries_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver = DistReceiver(LOCAL)
    stalled = _pair(receiver, timeout_s=10.0)
    tensor = torch.arange(64, dtype=torch.float32)
    request = _request(stalled, tensor, 7, 10.0)
    recvs: list[Future[list[torch.Tensor]]] = []
    real_recv = PairChannel.recv

    def recording_recv(
        self: PairChannel, specs: list[tuple[torch.dtype, tuple[int, ...], int]]
    ) -> Future[list[torch.Tensor]]:
        recvs.append(real_recv(self, specs))
        return recvs[-1]

    monkeypatch.setattr(PairChannel, "recv", recording_recv)

    async def go() -> tuple[bool, float]:
        pending = asyncio.ensure_future(receiver.receive(request))  # the worker waits; the encoder never sends
        deadline = time.monotonic() + 30
        while not (recvs and recvs[0].running()):  # the worker's recv is blocked in gloo
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        receiver.drop(stalled.pair_id)  # closes the worker side while its recv is blocked
        # gloo cannot interrupt the worker's own wait, so a close that waited for it would return only after
        # the recv ended (by its 10 s timeout): returning first is returning at once.
        recv_ended_first = recvs[0].done()
        stalled.close()  # the encoder side goes too: its dropped connections fail the worker's recv
        with pytest.raises(DistError):
            await pending  # bounded: by the peer's close, else by the pair's own timeout
        return recv_ended_first, time.perf_counter() - start

    fresh = None
    try:
        recv_ended_first, failed_in = asyncio.run(go())
        assert not recv_ended_first and failed_in < 30  # only a hang misses this
        with pytest.raises(DistError, match="closed"):
            stalled.send([(tensor, 1)])  # a closed pair refuses work with the transport's own error
        fresh = _pair(receiver)  # the process, its store and its receiver carry on: a new pair works
        assert torch.equal(_transfer(receiver, fresh, tensor), tensor)
    finally:
        for pair in (stalled, fresh):
            if pair is not None:
                pair.close()
        receiver.close()


def test_a_failed_pair_raises_dist_error_and_a_new_pair_works() -> None:
    receiver = DistReceiver(LOCAL)
    first = _pair(receiver, timeout_s=1.0)
    tensor = torch.randn(3, 5).to(torch.bfloat16)
    second = None
    try:
        sent = first.send([(tensor, 99)])  # nobody receives tag 99 on the other side
        with pytest.raises(DistError, match="failed|timed out"):
            asyncio.run(receiver.receive(_request(first, tensor, 5, 1.0)))  # tag 5 never comes: fails, dropped
        first.close()
        with contextlib.suppress(DistError):  # gloo may have written the bytes before the peer went; no hang
            sent.result(timeout=10)
        second = _pair(receiver)
        assert torch.equal(_transfer(receiver, second, tensor), tensor)
    finally:
        first.close()
        if second is not None:
            second.close()
        receiver.close()


def test_nccl_environment_turns_fatal_error_handling_into_clean_up() -> None:
    assert nccl_environment({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "0"}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"
    }
    assert nccl_environment({**NCCL_ENVIRONMENT, "NCCL_DEBUG": "INFO"}) == {}


def test_prepare_nccl_environment_sets_and_says_what_it_overrides(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # TearDown: would end the process
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    with caplog.at_level(logging.WARNING, logger="services.common.transport_dist"):
        prepare_nccl_environment()
        prepare_nccl_environment()  # idempotent
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert [r.message for r in caplog.records if "overridden" in r.message] == [
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 overridden with 2: a failed torch.distributed pair must not end the process"
    ]


def test_pair_devices() -> None:
    assert pair_device("gloo") == torch.device("cpu")
    assert pair_device("gloo", "cuda:1") == torch.device("cpu")
    assert pair_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert pair_device("nccl", "cpu").type == "cuda"
    if not torch.cuda.is_available():
        assert pair_device("nccl") == torch.device("cuda")


def test_tensors_go_on_the_wire_without_copies() -> None:
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    wire = _wire_bytes(tensor, torch.device("cpu"))
    assert wire.dtype == torch.uint8 and wire.numel() == tensor.nbytes and wire.data_ptr() == tensor.data_ptr()
    strided = torch.randn(6, 4).t()  # not contiguous: one copy, needed
    copied = _wire_bytes(strided, torch.device("cpu"))
    assert copied.data_ptr() != strided.data_ptr() and torch.equal(copied.view(torch.float32).view(4, 6), strided)


def test_tensor_spec_checks_the_message() -> None:
    assert tensor_spec(common_pb2.TensorMeta(dtype="bfloat16", shape=[3, 2], nbytes=12)) == (torch.bfloat16, (3, 2))
    with pytest.raises(DistError, match="needs 24 bytes"):
        tensor_spec(common_pb2.TensorMeta(dtype="float32", shape=[3, 2], nbytes=12))
    with pytest.raises(DistError, match="unsupported"):
        tensor_spec(common_pb2.TensorMeta(dtype="int64", shape=[3], nbytes=24))
