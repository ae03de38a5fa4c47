"""Embedding transfer by torch.distributed point-to-point between one encoder and one worker.

Per (encoder, worker) pair: a 2-rank process group (worker rank 0, encoder rank 1) that meets
through a `TCPStore` the worker hosts on its dist port, under a key prefix unique to the pair.
gRPC carries the control messages (`DistConnect` makes a pair and answers the store's address;
`PushDist` names each item's mm_hash, dtype, shape and tag) and the bytes go by `send`/`recv` on
the pair's own thread. The same code serves gloo (CPU tensors) and NCCL (CUDA tensors); the
encoder names the backend in `DistConnect`.

Invariants:
- Every wait is bounded: store connect, group creation, each send and each recv use the pair's
  timeout. A pair that fails or times out once is closed and never used again; the next transfer
  makes a new pair under a new id.
- One pair runs one operation at a time, in submission order, on its single thread; the sender
  holds the pair for a whole push, so control messages and sends can never cross.
- Tensors travel as a flat uint8 view of their bytes: any dtype arrives bit-identical.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.common import tensor_codec
from services.common.rpc.epd.v1 import worker_pb2
from services.common.transport_grpc import Embedding

log = logging.getLogger(__name__)
WORKER_RANK, ENCODER_RANK = 0, 1
BACKENDS = ("gloo", "nccl")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class DistError(RuntimeError):
    """A torch.distributed transfer or pair set-up that failed; the message says which and why."""


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _new_group(store: dist.Store, rank: int, backend: str, timeout_s: float, hostname: str) -> tuple[Any, torch.device]:
    """A 2-rank process group on `store` (already prefixed for the pair) and its tensor device."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timedelta(timeout_s)
        gloo = dist.ProcessGroupGloo
        options._devices = [gloo.create_default_device() if hostname in _WILDCARD_HOSTS
                            else gloo.create_device(hostname=hostname)]
        return gloo(store, rank, 2, options), torch.device("cpu")
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available():
            raise DistError("backend nccl needs a CUDA build of torch and a visible GPU")
        options = nccl.Options()
        options._timeout = _timedelta(timeout_s)
        return nccl(store, rank, 2, options), torch.device("cuda", torch.cuda.current_device())
    raise DistError(f"unknown torch.distributed backend {backend!r}; use one of {', '.join(BACKENDS)}")


class PairChannel:
    """One side of a pair: its process group, built and used only on the pair's own thread."""

    def __init__(self, pair_id: str, backend: str, rank: int, timeout_s: float) -> None:
        self.pair_id, self.backend, self.rank, self.timeout_s = pair_id, backend, rank, timeout_s
        self._peer = 1 - rank
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dist-{pair_id[:8]}")
        self._group: Any = None
        self.device = torch.device("cpu")
        self._tags = itertools.count(1)
        self.closed = False

    def open(self, store_host: str, store_port: int, hostname: str, master: dist.Store | None = None) -> Future[None]:
        """Build the group on the pair thread (rendezvous with the peer through the store)."""
        def build() -> None:
            store = master if master is not None else dist.TCPStore(
                store_host, store_port, is_master=False, timeout=_timedelta(self.timeout_s))
            prefixed = dist.PrefixStore(f"epd/pair/{self.pair_id}", store)
            self._group, self.device = _new_group(prefixed, self.rank, self.backend, self.timeout_s, hostname)
        return self._executor.submit(build)

    def next_tag(self) -> int:
        return next(self._tags) % (1 << 31)

    def send(self, tensors: list[tuple[torch.Tensor, int]]) -> Future[int]:
        """Send each (tensor, tag) in order; resolves with the bytes sent."""
        def run() -> int:
            total = 0
            for tensor, tag in tensors:
                flat = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
                if flat.numel():  # an empty tensor is all metadata: nothing to send (the receiver skips it too)
                    self._group.send([flat], self._peer, tag).wait(_timedelta(self.timeout_s))
                total += flat.numel()
            return total
        return self._executor.submit(run)

    def recv(self, sizes: list[tuple[int, int]]) -> Future[list[torch.Tensor]]:
        """Receive each (nbytes, tag) in order; resolves with flat uint8 tensors."""
        def run() -> list[torch.Tensor]:
            out = []
            for nbytes, tag in sizes:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                if nbytes:
                    self._group.recv([buffer], self._peer, tag).wait(_timedelta(self.timeout_s))
                out.append(buffer)
            return out
        return self._executor.submit(run)

    def close(self) -> None:
        """Never use this pair again; a blocked operation ends by its own timeout."""
        self.closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)


def as_tensor(raw: torch.Tensor, meta: Any) -> torch.Tensor:
    """View received flat bytes as the dtype and shape of `meta` (a TensorMeta); checks the size."""
    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DistError(f"unsupported embedding dtype {meta.dtype!r}")
    tensor_codec.dtype_name(dtype)  # raises for dtypes embeddings never use
    shape = tuple(int(d) for d in meta.shape)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != raw.numel():
        raise DistError(f"{meta.dtype}{list(shape)} needs {numel * dtype.itemsize} bytes, got {raw.numel()}")
    return raw.view(dtype).reshape(shape)


async def wait_bounded(future: Future[Any], timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        raise DistError(f"{what} timed out after {timeout_s:.1f}s") from None
    except DistError:
        raise
    except Exception as exc:  # torch raises RuntimeError / DistError subclasses of its own
        raise DistError(f"{what} failed: {exc}") from exc


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
    """

    def __init__(self, address: ReceiverAddress) -> None:
        if not 0 <= address.port < 65536:
            raise ValueError(f"EPD_DIST_PORT: {address.port} is not a port")
        self._address = address
        self._store: dist.TCPStore | None = None
        self._pairs: dict[str, PairChannel] = {}
        self._ready: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_service(cls, host: str, advertised: str) -> DistReceiver:
        """A receiver bound to the service's host, advertising the host part of `advertised`
        (its host:port), on the port `EPD_DIST_PORT` names."""
        from services.common import config as config_lib

        port = config_lib.load(DistListenConfig).dist_port
        return cls(ReceiverAddress(host, advertised.rsplit(":", 1)[0] or host, port))

    def _store_locked(self, timeout_s: float) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(self._address.bind_host, self._address.port, is_master=True,
                                        wait_for_workers=False, timeout=_timedelta(timeout_s))
        return self._store

    def connect(self, request: worker_pb2.DistConnectRequest) -> worker_pb2.DistConnectReply:
        """Start this side of a new pair (it completes when the encoder joins, or times out)."""
        if request.backend not in BACKENDS:
            raise DistError(f"unknown torch.distributed backend {request.backend!r}")
        if not request.pair_id:
            raise DistError("DistConnect needs a pair_id")
        timeout = request.timeout_s or 30.0
        with self._lock:
            if request.pair_id in self._pairs:
                raise DistError(f"pair {request.pair_id} already exists")
            store = self._store_locked(timeout)
            channel = PairChannel(request.pair_id, request.backend, WORKER_RANK, timeout)
            self._pairs[request.pair_id] = channel
            ready = channel.open("", 0, self._address.advertise_host, master=store)
            self._ready[request.pair_id] = ready
        ready.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self.drop(request.pair_id))
        return worker_pb2.DistConnectReply(store_addr=f"{self._address.advertise_host}:{store.port}")

    async def receive(self, request: worker_pb2.DistTransfer) -> list[Embedding]:
        """Receive every item `request` names, in order; DistError (pair dropped) on any failure."""
        with self._lock:
            channel, ready = self._pairs.get(request.pair_id), self._ready.get(request.pair_id)
        if channel is None or ready is None:
            raise DistError(f"unknown or failed pair {request.pair_id!r}; connect again")
        timeout = request.timeout_s or channel.timeout_s
        try:
            await wait_bounded(ready, timeout, f"pair {request.pair_id[:8]} set-up")
            sizes = [(int(item.meta.nbytes), int(item.tag)) for item in request.items]
            raws = await wait_bounded(channel.recv(sizes), timeout * max(1, len(sizes)), "receiving embeddings")
            return [Embedding(item.mm_hash, as_tensor(raw, item.meta))
                    for item, raw in zip(request.items, raws, strict=True)]
        except DistError:
            self.drop(request.pair_id)
            raise

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
