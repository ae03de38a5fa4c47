"""Sending a request's uncached media items to encoders, with failover.

Each item goes to the encoder that owns its `mm_hash` by rendezvous hashing over the registered
encoders (so one image meets one encoder cluster-wide and is encoded once), with the admitted
worker as destination. An encoder that is unreachable or fails is skipped and the items go to the
next one; when none is left, the worker encodes them itself (co-located fallback: every worker also
serves `epd.v1.Encoder`). Bad media (INVALID_ARGUMENT) fails the request at once; when every
encoder is busy the client gets RESOURCE_EXHAUSTED with the encoders' `retry-after-ms`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.embedding_cache import EmbeddingCache
from services.common.placement_hash import group_by_encoder
from services.common.rpc.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.router.cluster_view import ClusterView
from services.router.errors import RequestError, invalid, unavailable
from services.router.request_record import note_encoder

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)


@dataclass(frozen=True)
class Failure:
    """Why one place could not encode: a description, and the retry hint when it was only busy."""

    text: str
    retry_after_ms: str | None = None


class EncodeDispatcher:
    def __init__(
        self,
        view: ClusterView,
        cache: EmbeddingCache,
        channel: Callable[[str], grpc.aio.Channel],
        static_encoders: list[str],
        on_lookup: Callable[[int, int], None] = lambda queries, hits: None,
    ) -> None:
        self._on_lookup = on_lookup
        self._view = view
        self._cache = cache
        self._channel = channel
        self._static = static_encoders

    def _encoders(self) -> list[str]:
        return [e.address for e in self._view.encoders()] or list(self._static)

    async def encode(
        self, request_id: str, refs: list[common_pb2.MediaRef], data: list[bytes], worker: str, deadline: float
    ) -> float:
        """Make every item's embedding reach `worker`; returns seconds spent (0 when all cached)."""
        if not refs:
            return 0.0
        start = time.perf_counter()
        cached = await asyncio.to_thread(self._cache.contains, [r.mm_hash for r in refs])
        self._on_lookup(len(refs), sum(cached))
        items = [
            encoder_pb2.EncodeItem(ref=ref, data=blob)
            for ref, blob, hit in zip(refs, data, cached, strict=True)
            if not hit
        ]
        if not items:
            return 0.0
        encoders = self._encoders()
        groups = group_by_encoder([item.ref.mm_hash for item in items], encoders) if encoders else {worker: []}
        calls = [
            self._encode_group(request_id, [items[i] for i in indexes] or items, owner, encoders, worker, deadline)
            for owner, indexes in groups.items()
        ]
        await asyncio.gather(*calls)
        return time.perf_counter() - start

    async def _encode_group(
        self,
        request_id: str,
        items: list[encoder_pb2.EncodeItem],
        owner: str,
        encoders: list[str],
        worker: str,
        deadline: float,
    ) -> None:
        """Encode on the items' owner (rendezvous hashing: one image meets one encoder cluster-wide),
        failing over to the other encoders, then to the worker itself (co-located encoding)."""
        request = encoder_pb2.EncodeRequest(request_id=request_id, items=items, destination=worker)
        failures: list[Failure] = []
        for encoder in list(dict.fromkeys([owner, *encoders])) if encoders else []:
            failure = await self._try(encoder, request, deadline)
            if failure is None:
                return
            failures.append(failure)
        hints = [f.retry_after_ms for f in failures]
        if failures and all(hint is not None for hint in hints):
            # overload is refused, not pushed onto the worker: decode latency stays flat
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "every encoder is busy; retry later",
                (("retry-after-ms", str(hints[-1])),),
            )
        failure = await self._try(worker, request, deadline)
        if failure is None:
            return
        failures.append(failure)
        summary = "; ".join(f.text for f in failures)
        raise unavailable(f"no encoder could encode the request's images ({summary})")

    async def _try(self, address: str, request: encoder_pb2.EncodeRequest, deadline: float) -> Failure | None:
        """One Encode call; None on success, the failure when another place may still succeed.
        Bad media and non-retryable statuses raise: no other encoder would do better."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Failure(f"{address}: deadline")
        request.deadline_s = remaining
        try:
            await encoder_pb2_grpc.EncoderStub(self._channel(address)).Encode(request, timeout=remaining)
            note_encoder(address)
            return None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(exc.details()) from exc
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "500")
                return Failure(f"{address}: busy", hint)
            if exc.code() not in RETRYABLE:
                raise RequestError(exc.code(), f"encoder {address}: {exc.details()}") from exc
            return Failure(f"{address}: {exc.code().name}")
