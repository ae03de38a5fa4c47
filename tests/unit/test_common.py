"""Hashing, tensor codec, chunk transport and config loading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from services.common import config as config_lib
from services.common import tensor_codec
from services.common.hashing import ModelIdentity, mm_hash
from services.common.transport_grpc import ChunkAssembler, Embedding, StreamError, iter_chunks
from services.encoder.config import EncoderConfig
from services.worker.config import WorkerConfig

IDENTITY = ModelIdentity("qwen2_vl", "rev1", {"max_pixels": 100, "mean": [0.5, 0.5]})


def test_mm_hash_depends_on_every_field() -> None:
    base = mm_hash(IDENTITY, "image", b"abc")
    assert len(base) == 64 and base == mm_hash(IDENTITY, "image", b"abc")
    assert base != mm_hash(IDENTITY, "image", b"abd")
    assert base != mm_hash(IDENTITY, "video", b"abc")
    assert base != mm_hash(dataclasses.replace(IDENTITY, revision="rev2"), "image", b"abc")
    assert base != mm_hash(dataclasses.replace(IDENTITY, processor_settings={"max_pixels": 101}), "image", b"abc")
    # key order does not matter; length prefixing keeps field boundaries apart
    assert base == mm_hash(ModelIdentity("qwen2_vl", "rev1", {"mean": [0.5, 0.5], "max_pixels": 100}), "image", b"abc")
    assert mm_hash(ModelIdentity("ab", "c", {}), "image", b"") != mm_hash(ModelIdentity("a", "bc", {}), "image", b"")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codec_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    tensor = torch.randn(37, 11, generator=torch.Generator().manual_seed(0)).to(dtype)
    encoded = tensor_codec.encode(tensor)
    back = tensor_codec.decode(encoded.dtype, encoded.shape, encoded.data)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    with pytest.raises(tensor_codec.CodecError):
        tensor_codec.decode(encoded.dtype, (38, 11), encoded.data)


def test_chunks_stay_under_limit_and_reassemble() -> None:
    big = torch.randn(5_000_000 // 4 + 3)  # ~5 MB
    small = torch.randn(3, 4)
    messages = list(iter_chunks([Embedding("a" * 64, big), Embedding("b" * 64, small)]))
    assert all(m.ByteSize() < 1.1 * (1 << 20) for m in messages)
    assembler = ChunkAssembler()
    out = [e for m in messages if (e := assembler.add(m)) is not None]
    assembler.finish()
    assert [e.mm_hash for e in out] == ["a" * 64, "b" * 64]
    assert torch.equal(out[0].tensor, big) and torch.equal(out[1].tensor, small)
    broken = ChunkAssembler()
    broken.add(messages[0])
    with pytest.raises(StreamError):
        broken.finish()


def test_config_precedence_and_errors() -> None:
    env = {"EPD_MODEL": "/m", "EPD_BLOCK_SIZE": "32", "EPD_KV_CACHE_BYTES": "1000"}
    cfg = config_lib.load(WorkerConfig, env=env, kv_cache_bytes=5)
    assert (cfg.model, cfg.block_size, cfg.kv_cache_bytes, cfg.port) == ("/m", 32, 5, 50071)
    with pytest.raises(config_lib.ConfigError, match="EPD_BLOCK_SIZE"):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_BLOCK_SIZE": "many"})
    with pytest.raises(config_lib.ConfigError, match="EPD_MODEL"):
        config_lib.load(WorkerConfig, env={})
    with pytest.raises(config_lib.ConfigError, match="EPD_MAX_NUM_SEQS"):
        config_lib.load(WorkerConfig, env={"EPD_MODEL": "/m", "EPD_MAX_NUM_SEQS": "0"})
    assert config_lib.load(WorkerConfig, env=config_lib.to_env(cfg)) == cfg


@pytest.mark.parametrize(
    ("declared", "expected"),
    [({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
     ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"), ({}, "float32"), ({"dtype": "int8"}, "float32")],
)  # fmt: skip
def test_dtype_auto_is_what_the_folder_declares(tmp_path: Path, declared: dict, expected: str) -> None:
    """The default (`auto`) is resolved once, at load, to the folder's declared dtype (as transformers loads it),
    for the encoder and the worker alike; a setting names it outright; anything else is refused by name."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", **declared}))
    env = {"EPD_MODEL": str(tmp_path)}
    assert config_lib.load(WorkerConfig, env=env).dtype == expected
    assert config_lib.load(EncoderConfig, env=env).dtype == expected
    assert config_lib.load(WorkerConfig, env={**env, "EPD_DTYPE": "float16"}).dtype == "float16"
    with pytest.raises(config_lib.ConfigError, match="EPD_DTYPE: unknown dtype 'half'"):
        config_lib.load(WorkerConfig, env={**env, "EPD_DTYPE": "half"})
