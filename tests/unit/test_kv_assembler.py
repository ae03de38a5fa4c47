"""`Worker.PushKV`'s messages (services/worker/kv_transfer.py): a chunk cut into ~1 MiB messages comes back equal,
its tensors views of one buffer sized by its header; streams carrying more or fewer bytes than the header says,
or none, are refused."""

from __future__ import annotations

import pytest
import torch

from services.common.transport_grpc import StreamError
from services.worker.engine.kv_connector import FirstToken, KVChunk
from services.worker.engine.request import TokenLogprobs
from services.worker.kv_transfer import KVAssembler, chunk_messages


def _chunk(blocks: int, dtype: torch.dtype = torch.float32, first: FirstToken | None = None) -> KVChunk:
    keys = torch.randn(3, 2, blocks, 16, 32).to(dtype)
    return KVChunk("r", 4, 4 * 16 + blocks * 16, keys, torch.randn_like(keys.float()).to(dtype), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_come_back_equal_as_views_of_one_buffer(dtype: torch.dtype) -> None:
    first = FirstToken(7, TokenLogprobs(-0.5, (7, 3), (-0.5, -1.5)), 2)
    chunks = [_chunk(40, dtype), _chunk(1, dtype), _chunk(0, dtype, first)]
    assembler = KVAssembler()
    out = []
    for chunk in chunks:
        messages = list(chunk_messages(chunk, size=64 << 10))
        assert len(messages) == max(1, -(-chunk.nbytes // (64 << 10)))
        got = [assembler.add(m) for m in messages]
        assert got[:-1] == [None] * (len(messages) - 1)
        out.append(got[-1])
    assembler.finish()
    for sent, got in zip(chunks, out, strict=True):
        assert torch.equal(got.keys, sent.keys) and torch.equal(got.values, sent.values)
        assert (got.first_block, got.num_tokens, got.first_token) == (
            sent.first_block,
            sent.num_tokens,
            sent.first_token,
        )
    big = out[0]
    assert big.values.data_ptr() == big.keys.data_ptr() + big.keys.nbytes  # one buffer, keys then values: no copy
    assert assembler.total_bytes == sum(c.nbytes for c in chunks)


def test_malformed_streams_are_refused() -> None:
    messages = list(chunk_messages(_chunk(8), size=8 << 10))
    with pytest.raises(StreamError, match="without its header"):
        KVAssembler().add(messages[1])
    short = KVAssembler()
    for m in messages[:-2]:
        short.add(m)
    with pytest.raises(StreamError, match="bytes short"):
        short.add(messages[-1])
    long = KVAssembler()
    for m in messages[:-1]:
        long.add(m)
    messages[-1].data += b"extra"
    with pytest.raises(StreamError, match="more bytes"):
        long.add(messages[-1])
    unfinished = KVAssembler()
    unfinished.add(messages[0])
    with pytest.raises(StreamError, match="ended inside"):
        unfinished.finish()
