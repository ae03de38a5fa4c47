"""Tensor transfer by torch.distributed point-to-point between a sending service and one worker.

Per (sender, worker) pair: a 2-rank process group (the receiving worker rank 0, the sender rank 1) that meets
through a `TCPStore` the worker hosts on its dist port, under a key prefix unique to the pair. Two senders use
it: an encoder pushing embeddings (services/encoder/push.py, control `PushDist`) and a prefill worker pushing
KV chunks to its decode worker (services/worker/kv_transfer.py, control `PushKV` with `KVBlocks.pair_id`).
gRPC carries the control messages (`DistConnect` makes a pair and answers the store's address; each transfer's
message names dtypes, shapes and tags) and the bytes go by `send`/`recv` on the pair's own thread. The same code
serves gloo (CPU tensors) and NCCL (CUDA tensors); the sender names the backend in `DistConnect`.
The sending side's pairs, one per worker address, are `SenderPairs` (dist_sender.py); the worker's side is
`DistReceiver` (dist_receiver.py).

Invariants:
- Every wait is bounded: store connect, group creation, each send and each recv use the pair's
  timeout. A pair that fails or times out once is closed and never used again; the next transfer
  makes a new pair under a new id.
- One pair runs one operation at a time, in submission order, on its single thread; a sender holds the
  pair's lock (`dist_sender.SenderPairs.lock`) from a transfer's control message until its sends completed, so
  control messages and sends can never cross.
- Tensors travel as a flat uint8 view of their bytes: any dtype arrives bit-identical. No extra copy:
  a contiguous tensor on the pair's device is sent as it is; the receiver receives into tensors it
  allocated once, in their dtype and shape on its device.
- A stalled or failed pair never ends the process: errors surface as DistError; `close` returns at
  once and aborts the communicator; for NCCL the process runs with `NCCL_ENVIRONMENT` (the watchdog
  aborts a failed or timed-out communicator instead of killing the process; no heartbeat monitor).
  Pairs are standalone backends, never registered with the default group (`destroy_process_group`
  does not apply).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from services.common import tensor_codec

log = logging.getLogger(__name__)
T = TypeVar("T")
RECEIVER_RANK, SENDER_RANK = 0, 1  # the worker that receives; the encoder or prefill worker that sends
BACKENDS = ("gloo", "nccl")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

NCCL_ENVIRONMENT = {
    # 2 = CleanUpOnly: when the watchdog sees an op fail or pass the pair's timeout it aborts that
    # communicator and marks the op failed; the default (3, SkipCleanUp) and 1 (TearDown) end the process.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # No heartbeat monitor: it kills the process when the watchdog thread itself hangs (say, in an abort).
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
"""What a serving process sets before its first NCCL pair: a stalled or failed pair is closed, never fatal."""
_nccl_lock = threading.Lock()


class DistError(RuntimeError):
    """A torch.distributed transfer or pair set-up that failed; the message says which and why."""


def as_timedelta(seconds: float) -> datetime.timedelta:
    """`seconds` (at least a millisecond) as torch.distributed takes timeouts."""
    return datetime.timedelta(seconds=max(seconds, 0.001))


def nccl_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `NCCL_ENVIRONMENT` that `env` lacks or sets otherwise, with the values to set."""
    return {name: value for name, value in NCCL_ENVIRONMENT.items() if env.get(name) != value}


def prepare_nccl_environment() -> None:
    """Set `NCCL_ENVIRONMENT` in this process (read by each ProcessGroupNCCL when it is built), saying so
    where it overrides an operator's value. Idempotent; call before the first NCCL pair."""
    with _nccl_lock:
        for name, value in nccl_environment(os.environ).items():
            if name in os.environ:
                log.warning(
                    "%s=%s overridden with %s: a failed torch.distributed pair must not end the process",
                    name,
                    os.environ[name],
                    value,
                )
            os.environ[name] = value


def pair_device(backend: str, device: str | torch.device | None = None) -> torch.device:
    """The device a pair's tensors travel from: the host for gloo; for NCCL the CUDA `device` (none, or
    one without an index, is the caller's current CUDA device; a non-CUDA device means the current one)."""
    if backend != "nccl":
        return torch.device("cpu")
    chosen = torch.device("cuda") if device is None else torch.device(device)
    if chosen.type != "cuda":
        chosen = torch.device("cuda")
    if chosen.index is None and torch.cuda.is_available():
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def _new_group(
    store: dist.Store, rank: int, backend: str, timeout_s: float, hostname: str, device: torch.device
) -> Any:
    """A 2-rank process group on `store` (already prefixed for the pair), for tensors on `device`."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = as_timedelta(timeout_s)
        gloo = dist.ProcessGroupGloo
        wildcard = hostname in _WILDCARD_HOSTS
        options._devices = [gloo.create_default_device() if wildcard else gloo.create_device(hostname=hostname)]
        return gloo(store, rank, 2, options)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available() or device.index is None:
            raise DistError("backend nccl needs a CUDA build of torch and a visible GPU")
        prepare_nccl_environment()
        torch.cuda.set_device(device)  # this (the pair's) thread's device: NCCL's streams and buffers live there
        options = nccl.Options()
        options._timeout = as_timedelta(timeout_s)  # the watchdog's bound on every op (then CleanUpOnly aborts)
        return nccl(store, rank, 2, options)
    raise DistError(f"unknown torch.distributed backend {backend!r}; use one of {', '.join(BACKENDS)}")


def _abort(group: Any, pair_id: str) -> None:
    """Abort a pair's communicator: NCCL aborts its communicators (pending ops fail at once; never the
    graceful shutdown, which would wait for them); gloo drops its connections when its last reference
    goes, which fails the peer's pending ops."""
    try:
        group.abort()
    except Exception as exc:  # a backend without abort, or one already torn down
        log.debug("aborting pair %s: %s", pair_id[:8], exc)


def _wire_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view on `device`: no copy for a contiguous tensor already there."""
    tensor = tensor.detach()
    if tensor.device != device:
        tensor = tensor.to(device)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


class PairChannel:
    """One side of a pair: its process group, built and used only on the pair's own thread.

    `close` may come from any thread at any time: queued operations are cancelled, the communicator is
    aborted on a short-lived thread (so `close` returns at once), and an operation already waiting ends
    with DistError (NCCL: at the abort; gloo: at its own timeout, gloo cannot interrupt a wait).
    """

    def __init__(
        self, pair_id: str, backend: str, rank: int, timeout_s: float, device: str | torch.device | None = None
    ) -> None:
        self.pair_id, self.backend, self.rank, self.timeout_s = pair_id, backend, rank, timeout_s
        self._peer = 1 - rank
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dist-{pair_id[:8]}")
        self._group: Any = None
        self._state = threading.Lock()
        self.device = pair_device(backend, device)
        self._tags = itertools.count(1)
        self.closed = False

    def open(self, store_host: str, store_port: int, hostname: str, master: dist.Store | None = None) -> Future[None]:
        """Build the group on the pair thread (rendezvous with the peer through the store)."""

        def build() -> None:
            try:
                store = master
                if store is None:
                    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=as_timedelta(self.timeout_s))
                prefixed = dist.PrefixStore(f"epd/pair/{self.pair_id}", store)
                group = _new_group(prefixed, self.rank, self.backend, self.timeout_s, hostname, self.device)
            except DistError:
                raise
            except Exception as exc:
                raise DistError(f"pair {self.pair_id[:8]} set-up failed: {exc}") from exc
            with self._state:
                if not self.closed:
                    self._group = group
                    return
            _abort(group, self.pair_id)
            raise DistError(f"pair {self.pair_id[:8]} was closed during set-up")

        return self._submit(build)

    def next_tag(self) -> int:
        return next(self._tags) % (1 << 31)

    def send(self, tensors: list[tuple[torch.Tensor, int]]) -> Future[int]:
        """Send each (tensor, tag) in order, each from `device` as it is (contiguous tensors there are not
        copied); resolves with the bytes sent, or fails with DistError."""

        def run() -> int:
            total = 0
            for tensor, tag in tensors:
                flat = _wire_bytes(tensor, self.device)
                if flat.numel():  # an empty tensor is all metadata: nothing to send (the receiver skips it too)
                    self._wait(self._live().send([flat], self._peer, tag), "send")
                total += flat.numel()
            return total

        return self._submit(run)

    def recv(self, specs: list[tuple[torch.dtype, tuple[int, ...], int]]) -> Future[list[torch.Tensor]]:
        """Receive each (dtype, shape, tag) in order, straight into a new tensor of that dtype and shape on
        `device`; resolves with those tensors, or fails with DistError."""

        def run() -> list[torch.Tensor]:
            out = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape, _ in specs]
            self._recv_all([(tensor, tag) for tensor, (_, _, tag) in zip(out, specs, strict=True)])
            return out

        return self._submit(run)

    def recv_into(self, targets: list[tuple[torch.Tensor, int]]) -> Future[int]:
        """Receive each (tensor, tag) in order into that tensor (contiguous, on `device`: views of one buffer the
        caller allocated, say); resolves with the bytes received, or fails with DistError."""
        for tensor, _ in targets:
            if tensor.device != self.device or not tensor.is_contiguous():
                raise DistError(f"pair {self.pair_id[:8]} receives into contiguous tensors on {self.device}")

        return self._submit(lambda: self._recv_all(targets))

    def _recv_all(self, targets: list[tuple[torch.Tensor, int]]) -> int:
        total = 0
        for tensor, tag in targets:
            if tensor.numel():  # an empty tensor is all metadata: the sender skips it too
                flat = tensor.reshape(-1).view(torch.uint8)
                self._wait(self._live().recv([flat], self._peer, tag), "recv")
                total += flat.numel()
        return total

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        try:
            return self._executor.submit(fn)
        except RuntimeError:  # the executor is shut down: the pair was closed
            raise DistError(f"pair {self.pair_id[:8]} is closed") from None

    def _live(self) -> Any:
        with self._state:
            if self.closed or self._group is None:
                raise DistError(f"pair {self.pair_id[:8]} is closed")
            return self._group

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(as_timedelta(self.timeout_s))
        except Exception as exc:  # gloo: RuntimeError; NCCL: DistBackendError (the communicator is aborted)
            raise DistError(f"pair {self.pair_id[:8]} {what} failed: {exc}") from exc

    def close(self) -> None:
        """Never use this pair again; returns at once (see the class docstring)."""
        with self._state:
            if self.closed:
                return
            self.closed = True
            group, self._group = self._group, None
        self._executor.shutdown(wait=False, cancel_futures=True)
        if group is not None:
            name = f"dist-abort-{self.pair_id[:8]}"
            threading.Thread(target=_abort, args=(group, self.pair_id), name=name, daemon=True).start()


def _dtype_shape(meta: Any) -> tuple[torch.dtype, tuple[int, ...], int]:
    """The dtype, shape and byte size `meta` (a TensorMeta) describes; DistError for an unsupported dtype."""
    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DistError(f"unsupported embedding dtype {meta.dtype!r}")
    try:
        tensor_codec.dtype_name(dtype)  # raises for dtypes embeddings never use
    except tensor_codec.CodecError as exc:
        raise DistError(str(exc)) from None
    shape = tuple(int(d) for d in meta.shape)
    numel = 1
    for dim in shape:
        numel *= dim
    return dtype, shape, numel * dtype.itemsize


def tensor_spec(meta: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape a received item gets; DistError when unsupported or when `nbytes` disagrees."""
    dtype, shape, nbytes = _dtype_shape(meta)
    if nbytes != meta.nbytes:
        raise DistError(f"{meta.dtype}{list(shape)} needs {nbytes} bytes, the message says {meta.nbytes}")
    return dtype, shape


def as_tensor(raw: torch.Tensor, meta: Any) -> torch.Tensor:
    """View received flat bytes as the dtype and shape of `meta` (a TensorMeta); checks the size."""
    dtype, shape, nbytes = _dtype_shape(meta)
    if nbytes != raw.numel():
        raise DistError(f"{meta.dtype}{list(shape)} needs {nbytes} bytes, got {raw.numel()}")
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
