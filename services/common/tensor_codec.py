"""Raw tensor bytes <-> torch tensors, and slicing them into transport chunks.

Encoding is lossless: `decode(encode(t))` is bit-identical to `t` (dtype and shape kept).
Only float32, float16 and bfloat16 are accepted: those are what embeddings travel as.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

CHUNK_BYTES = 1 << 20  # ~1 MiB per gRPC message, well under the 4 MiB default cap

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as bytes plus what is needed to rebuild it."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


class CodecError(ValueError):
    """Bytes that cannot be a tensor of the declared dtype and shape."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; raises CodecError for unsupported ones."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise CodecError(f"unsupported embedding dtype {dtype}")


def encode(tensor: torch.Tensor) -> EncodedTensor:
    """Serialise a tensor's raw bytes (contiguous, on CPU)."""
    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return EncodedTensor(dtype=name, shape=tuple(tensor.shape), data=raw)


def decode(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    """Rebuild a tensor; raises CodecError when sizes do not match."""
    if dtype not in _DTYPES:
        raise CodecError(f"unsupported embedding dtype {dtype!r}")
    torch_dtype = _DTYPES[dtype]
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * torch.tensor([], dtype=torch_dtype).element_size()
    if len(data) != expected:
        raise CodecError(f"tensor {dtype}{list(shape)} needs {expected} bytes, got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(shape).clone()


def view(dtype: str, shape: tuple[int, ...], buffer: bytearray, offset: int = 0) -> torch.Tensor:
    """`decode` without a copy: the tensor over ``buffer[offset:]``'s first bytes, which it keeps alive (so the
    caller must not reuse the buffer); raises CodecError when ``buffer`` is too short or the offset unaligned."""
    if dtype not in _DTYPES:
        raise CodecError(f"unsupported tensor dtype {dtype!r}")
    torch_dtype = _DTYPES[dtype]
    size = torch.tensor([], dtype=torch_dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    if offset % size or offset + numel * size > len(buffer):
        raise CodecError(f"tensor {dtype}{list(shape)} does not fit {len(buffer)} bytes at offset {offset}")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=numel * size, offset=offset)
    return raw.view(torch_dtype).reshape(shape)


def chunks(data: bytes, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Yield `data` in slices of at most `size` bytes (one empty slice for empty data)."""
    if not data:
        yield b""
        return
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield bytes(view[start : start + size])
