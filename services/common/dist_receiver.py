"""The worker side of the torch.distributed transport (`transport_dist.py`): the TCPStore every pair meets
through, one `PairChannel` per sender (an encoder, or a prefill worker pushing KV), and what each transfer's
control message names received in order."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.common.rpc.epd.v1 import worker_pb2
from services.common.transport_dist import (
    BACKENDS,
    RECEIVER_RANK,
    DistError,
    PairChannel,
    as_timedelta,
    prepare_nccl_environment,
    tensor_spec,
    wait_bounded,
)
from services.common.transport_grpc import Embedding


@dataclass(frozen=True)
class ReceiverAddress:
    """Where the worker's TCPStore listens and the host encoders are told to dial."""

    bind_host: str
    advertise_host: str
    port: int = 0  # 0: a free port, chosen when the first pair connects


@dataclass
class DistListenConfig:
    """The worker's dist port (env `EPD_DIST_PORT`; 0 picks a free one, told to encoders in DistConnect)."""

    dist_port: int = 0


class DistReceiver:
    """The worker side: hosts the store, accepts pairs, receives pushed items.

    Invariant: `_pairs` holds only pairs that never failed; a failed or timed-out pair is closed
    and removed at once, so a later `PushDist` for it is refused (the encoder then re-pairs).
    NCCL pairs receive on `device` (default: the current CUDA device); gloo pairs on the host.
    """

    def __init__(self, address: ReceiverAddress, device: str | torch.device | None = None) -> None:
        if not 0 <= address.port < 65536:
            raise ValueError(f"EPD_DIST_PORT: {address.port} is not a port")
        self._address = address
        self._device = device
        self._store: dist.TCPStore | None = None
        self._pairs: dict[str, PairChannel] = {}
        self._ready: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_service(cls, host: str, advertised: str, device: str | torch.device | None = None) -> DistReceiver:
        """A receiver bound to the service's host, advertising the host part of `advertised`
        (its host:port), on the port `EPD_DIST_PORT` names."""
        from services.common import config as config_lib

        port = config_lib.load(DistListenConfig).dist_port
        return cls(ReceiverAddress(host, advertised.rsplit(":", 1)[0] or host, port), device)

    def _store_locked(self, timeout_s: float) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(
                self._address.bind_host,
                self._address.port,
                is_master=True,
                wait_for_workers=False,
                timeout=as_timedelta(timeout_s),
            )
        return self._store

    def connect(self, request: worker_pb2.DistConnectRequest) -> worker_pb2.DistConnectReply:
        """Start this side of a new pair (it completes when the encoder joins, or times out)."""
        if request.backend not in BACKENDS:
            raise DistError(f"unknown torch.distributed backend {request.backend!r}")
        if not request.pair_id:
            raise DistError("DistConnect needs a pair_id")
        timeout = request.timeout_s or 30.0
        if request.backend == "nccl":
            prepare_nccl_environment()  # here, before the pair thread exists, rather than on it
        with self._lock:
            if request.pair_id in self._pairs:
                raise DistError(f"pair {request.pair_id} already exists")
            store = self._store_locked(timeout)
            channel = PairChannel(request.pair_id, request.backend, RECEIVER_RANK, timeout, self._device)
            self._pairs[request.pair_id] = channel
            ready = channel.open("", 0, self._address.advertise_host, master=store)
            self._ready[request.pair_id] = ready
        ready.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self.drop(request.pair_id))
        return worker_pb2.DistConnectReply(store_addr=f"{self._address.advertise_host}:{store.port}")

    async def receive(self, request: worker_pb2.DistTransfer) -> list[Embedding]:
        """Receive every item `request` names, in order; DistError (pair dropped) on any failure."""
        timeout = request.timeout_s or None
        try:
            specs = [(*tensor_spec(item.meta), int(item.tag)) for item in request.items]
        except DistError:
            self.drop(request.pair_id)
            raise
        tensors = await self._run(request.pair_id, lambda channel: channel.recv(specs), len(specs), timeout)
        return [Embedding(item.mm_hash, tensor) for item, tensor in zip(request.items, tensors, strict=True)]

    async def receive_into(
        self, pair_id: str, targets: list[tuple[torch.Tensor, int]], timeout_s: float | None = None
    ) -> int:
        """Receive each (tensor, tag) in order into that tensor (contiguous, on this receiver's device for the
        pair's backend); the bytes received. DistError (pair dropped) on any failure, within `timeout_s` (default:
        the pair's) per tensor."""
        return await self._run(pair_id, lambda channel: channel.recv_into(targets), len(targets), timeout_s)

    async def _run(self, pair_id: str, op: Any, count: int, timeout_s: float | None) -> Any:
        with self._lock:
            channel, ready = self._pairs.get(pair_id), self._ready.get(pair_id)
        if channel is None or ready is None:
            raise DistError(f"unknown or failed pair {pair_id!r}; connect again")
        timeout = timeout_s or channel.timeout_s
        try:
            await wait_bounded(ready, timeout, f"pair {pair_id[:8]} set-up")
            return await wait_bounded(op(channel), timeout * max(1, count), "receiving")
        except DistError:
            self.drop(pair_id)
            raise

    def device_for(self, pair_id: str) -> torch.device:
        """Where a pair's tensors land (the host for gloo); DistError for an unknown or failed pair."""
        with self._lock:
            channel = self._pairs.get(pair_id)
        if channel is None:
            raise DistError(f"unknown or failed pair {pair_id!r}; connect again")
        return channel.device

    def drop(self, pair_id: str) -> None:
        with self._lock:
            channel = self._pairs.pop(pair_id, None)
            self._ready.pop(pair_id, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for pair_id in list(self._pairs):
            self.drop(pair_id)
        self._store = None
