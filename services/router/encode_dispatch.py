"""Sending a request's uncached media items to encoders, with failover.

Items go to the least-loaded registered encoder with the admitted worker as destination. An
encoder that is unreachable or fails is skipped and the items go to the next one; when none is
left, the worker encodes them itself (co-located fallback: every worker also serves
`epd.v1.Encoder`). Bad media (INVALID_ARGUMENT from an encoder) fails the request at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from services.common.embedding_cache import EmbeddingCache
from services.common.rpc.epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.router.cluster_view import ClusterView
from services.router.errors import RequestError, invalid, unavailable

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.CANCELLED})


class EncodeDispatcher:
    def __init__(self, view: ClusterView, cache: EmbeddingCache, channel: Callable[[str], grpc.aio.Channel],
                 static_encoders: list[str], on_lookup: Callable[[int, int], None] = lambda queries, hits: None,
                 ) -> None:
        self._on_lookup = on_lookup
        self._view = view
        self._cache = cache
        self._channel = channel
        self._static = static_encoders

    def _candidates(self) -> list[str]:
        encoders = sorted(self._view.encoders(), key=lambda e: e.queued_tokens)
        return [e.address for e in encoders] or list(self._static)

    async def encode(self, request_id: str, refs: list[common_pb2.MediaRef], data: list[bytes], worker: str,
                     deadline: float) -> float:
        """Make every item's embedding reach `worker`; returns seconds spent (0 when all cached)."""
        if not refs:
            return 0.0
        start = time.perf_counter()
        cached = await asyncio.to_thread(lambda: [self._cache.contains(r.mm_hash) for r in refs])
        self._on_lookup(len(refs), sum(cached))
        items = [encoder_pb2.EncodeItem(ref=ref, data=blob)
                 for ref, blob, hit in zip(refs, data, cached, strict=True) if not hit]
        if not items:
            return 0.0
        request = encoder_pb2.EncodeRequest(request_id=request_id, items=items, destination=worker)
        failures: list[str] = []
        for encoder in [*self._candidates(), worker]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            request.deadline_s = remaining
            try:
                await encoder_pb2_grpc.EncoderStub(self._channel(encoder)).Encode(request, timeout=remaining)
                return time.perf_counter() - start
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise invalid(exc.details()) from exc
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    failures.append(f"{encoder}: busy")
                    continue
                if exc.code() not in RETRYABLE:
                    raise RequestError(exc.code(), f"encoder {encoder}: {exc.details()}") from exc
                failures.append(f"{encoder}: {exc.code().name}")
        raise unavailable(f"no encoder could encode the request's images ({'; '.join(failures) or 'deadline'})")
