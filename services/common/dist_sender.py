"""The sending side of the torch.distributed transport (`transport_dist.py`): a service's pairs, one per worker it
pushes to (an encoder's embeddings, a prefill worker's KV), made on first use and reused until one fails."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import torch

from services.common.rpc.epd.v1 import worker_pb2
from services.common.transport_dist import (
    SENDER_RANK,
    PairChannel,
    pair_device,
    prepare_nccl_environment,
    wait_bounded,
)


class SenderPairs:
    """The sending side's pairs: one per worker address, made on first use and reused until it fails.

    `pair` asks the worker for a new pair (`DistConnect` through `stub(address)`, which answers its store's
    address) and joins it as rank 1; `drop` closes a failed one, so the next `pair` makes a new one under a new
    id. `lock(address)` is the asyncio lock a sender holds for each transfer (see the module invariants). Used on
    one event loop.
    """

    def __init__(
        self,
        stub: Callable[[str], Any],
        backend: str,
        hostname: str,
        timeout_s: float,
        device: str | torch.device | None = None,
    ) -> None:
        self._stub = stub
        self.backend = backend
        self._hostname = hostname
        self.timeout_s = timeout_s
        self.device = pair_device(backend, device)
        if backend == "nccl":
            prepare_nccl_environment()  # at start-up, before any pair thread
        self._pairs: dict[str, PairChannel] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def current(self, address: str) -> PairChannel | None:
        """The pair with `address` now (None before the first use and after a drop)."""
        return self._pairs.get(address)

    def lock(self, address: str) -> asyncio.Lock:
        return self._locks.setdefault(address, asyncio.Lock())

    async def pair(self, address: str, timeout_s: float) -> PairChannel:
        """The live pair with `address`, made now if there is none (within `timeout_s`; DistError, or the
        DistConnect call's grpc error, when that fails). Call with `lock(address)` held."""
        pair = self._pairs.get(address)
        if pair is not None and not pair.closed:
            return pair
        pair_id = uuid.uuid4().hex
        request = worker_pb2.DistConnectRequest(pair_id=pair_id, backend=self.backend, timeout_s=self.timeout_s)
        reply = await self._stub(address).DistConnect(request, timeout=timeout_s)
        host, _, port = reply.store_addr.rpartition(":")
        pair = PairChannel(pair_id, self.backend, SENDER_RANK, self.timeout_s, device=self.device)
        try:
            await wait_bounded(pair.open(host, int(port), self._hostname), timeout_s, f"pair set-up with {address}")
        except BaseException:
            pair.close()
            raise
        self._pairs[address] = pair
        return pair

    def drop(self, address: str, pair: PairChannel | None = None) -> None:
        """Close the pair with `address` (only if it is still `pair`, when given): the next use makes a new one."""
        current = self._pairs.get(address)
        if current is not None and (pair is None or current is pair):
            del self._pairs[address]
            current.close()
        elif pair is not None:
            pair.close()

    def close(self) -> None:
        for address in list(self._pairs):
            self.drop(address)
