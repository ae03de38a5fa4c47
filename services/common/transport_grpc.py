"""Embedding transfer over a gRPC client stream: the sender's chunking and the receiver's assembly.

Each item is sent as a run of `EmbeddingChunk`s: the first carries `meta` (dtype, shape, nbytes),
every chunk carries `mm_hash` and at most ~1 MiB of data, the last has `last=True`. Items on one
stream do not interleave. The assembler rejects a stream that breaks this shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from services.common import tensor_codec
from services.common.rpc.epd.v1 import common_pb2, worker_pb2


@dataclass(frozen=True)
class Embedding:
    """A projected embedding for one media item."""

    mm_hash: str
    tensor: torch.Tensor


def iter_chunks(
    items: Iterable[Embedding],
    chunk_bytes: int = tensor_codec.CHUNK_BYTES,
) -> Iterator[worker_pb2.EmbeddingChunk]:
    """Messages for a PushEmbeddings stream carrying `items` in order."""
    for item in items:
        encoded = tensor_codec.encode(item.tensor)
        meta = common_pb2.TensorMeta(dtype=encoded.dtype, shape=list(encoded.shape), nbytes=encoded.nbytes)
        pieces = list(tensor_codec.chunks(encoded.data, chunk_bytes))
        for index, piece in enumerate(pieces):
            yield worker_pb2.EmbeddingChunk(
                mm_hash=item.mm_hash,
                meta=meta if index == 0 else None,
                data=piece,
                last=index == len(pieces) - 1,
            )


class StreamError(ValueError):
    """A push stream that does not follow the chunk protocol."""


@dataclass
class ChunkAssembler:
    """Rebuilds embeddings from chunks; `add` returns an Embedding when an item completes."""

    _hash: str | None = None
    _meta: common_pb2.TensorMeta | None = None
    _parts: list[bytes] = field(default_factory=list)
    _received: int = 0
    total_bytes: int = 0

    def add(self, chunk: worker_pb2.EmbeddingChunk) -> Embedding | None:
        if self._hash is None:
            if not chunk.HasField("meta"):
                raise StreamError(f"first chunk of item {chunk.mm_hash[:12]} has no tensor metadata")
            self._hash, self._meta = chunk.mm_hash, chunk.meta
        elif chunk.mm_hash != self._hash:
            raise StreamError(f"chunk for {chunk.mm_hash[:12]} inside item {self._hash[:12]}")
        self._parts.append(chunk.data)
        self._received += len(chunk.data)
        self.total_bytes += len(chunk.data)
        if self._meta is not None and self._received > self._meta.nbytes:
            raise StreamError(f"item {self._hash[:12]} sent more bytes than its {self._meta.nbytes}")
        if not chunk.last:
            return None
        data = b"".join(self._parts)
        meta, mm_hash = self._meta, self._hash
        self._hash, self._meta, self._parts, self._received = None, None, [], 0
        tensor = tensor_codec.decode(meta.dtype, tuple(meta.shape), data)
        return Embedding(mm_hash, tensor)

    def finish(self) -> None:
        """Raise if the stream ended inside an item."""
        if self._hash is not None:
            raise StreamError(f"stream ended inside item {self._hash[:12]}")
