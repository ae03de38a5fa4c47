"""Co-located encoding: a worker that runs the vision tower itself.

Every worker serves `epd.v1.Encoder` with this servicer. The router uses it when no encoder
answers (they died or none is deployed), and it suits light image traffic. Embeddings go
straight into this worker's embedding store (no transfer) and into the shared cache. It only
encodes for itself: a request naming another worker as destination is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.embedding_cache import EmbeddingCache
from services.common.image_decode import load_image
from services.common.media import MediaError, MediaLimits, MediaReason
from services.common.rpc.epd.v1 import encoder_pb2, encoder_pb2_grpc
from services.models.vision_runner import VisionRunner
from services.worker.embedding_store import EmbeddingStore

log = logging.getLogger(__name__)


class LocalEncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(
        self, runner: VisionRunner, store: EmbeddingStore, cache: EmbeddingCache, limits: MediaLimits, address: str
    ) -> None:
        self._runner = runner
        self._store = store
        self._cache = cache
        self._limits = limits
        self.address = address  # set once the server knows its port

    def _decode(self, request: encoder_pb2.EncodeRequest) -> list:
        images = []
        for index, item in enumerate(request.items):
            if item.ref.modality == "video":  # decoding video needs the encoder's process pool and time bound
                raise MediaError(
                    "co-located encoding takes images only; video needs an encoder service",
                    MediaReason.FORMAT,
                    index=index,
                    media="video",
                )
            try:
                images.append(load_image(item.data, self._limits))
            except MediaError as exc:
                raise exc.with_index(index) from exc
        return images

    async def Encode(
        self,
        request: encoder_pb2.EncodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> encoder_pb2.EncodeResponse:
        if request.destination and request.destination != self.address:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {self.address} encodes only for itself, not for {request.destination}",
            )
        start = time.perf_counter()
        try:
            images = await asyncio.to_thread(self._decode, request)
        except MediaError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        batch = await asyncio.to_thread(self._runner.encode, images)
        for item, embedding in zip(request.items, batch.embeddings, strict=True):
            self._store.put(item.ref.mm_hash, embedding)
            await asyncio.to_thread(self._cache.put, item.ref.mm_hash, embedding)
        log.info("co-located encode of %d item(s) for request %s", len(images), request.request_id)
        return encoder_pb2.EncodeResponse(encoded=len(images), encode_s=time.perf_counter() - start)
