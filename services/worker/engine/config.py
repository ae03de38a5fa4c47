"""Engine configuration: one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("auto", "sdpa")


@dataclass
class EngineConfig:
    """Sizes and switches of one worker engine.

    ``kv_cache_bytes`` is the budget for the per-layer K and V block tensors; the number of blocks is
    derived from it and the model's shape. ``overcommit`` scales how many blocks admitted requests may
    reserve against the total (1.0: never more than exist, so preemption never happens).

    ``prefill_tokens_per_free_seq`` (0: off) gives decodes priority to keep inter-token latency flat:
    a step takes at most ``max(block_size, prefill_tokens_per_free_seq x (max_num_seqs - decodes))``
    prefill tokens (tokens of chunks longer than one), so a step with many decoding sequences carries a
    small prefill chunk and one with few a large one; set it near (cost of a decode) / (cost of a prefill
    token), and a step costs about a full decode step at most.

    ``attention_backend``: ``"auto"`` runs decode attention through the compiled CPU kernel where it applies
    (float32 on the CPU, 16-token blocks, head dims a multiple of 16, a C compiler present) and SDPA
    elsewhere; ``"sdpa"`` uses SDPA everywhere.
    """

    block_size: int = 16
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    overcommit: float = 1.0
    enable_prefix_caching: bool = True
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    prefill_tokens_per_free_seq: int = 0
    embedding_buffer_bytes: int = 256 * 1024 * 1024
    seed: int = 0
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.overcommit < 1.0:
            raise ValueError(f"EngineConfig.overcommit must be >= 1.0, got {self.overcommit}")
        if self.prefill_tokens_per_free_seq < 0:
            raise ValueError("EngineConfig.prefill_tokens_per_free_seq must be >= 0")
        if self.embedding_buffer_bytes < 0:
            raise ValueError("EngineConfig.embedding_buffer_bytes must be >= 0")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be positive, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"EngineConfig.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if isinstance(self.dtype, str) and self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV cache and activation dtype as a torch dtype."""
        return self.dtype if isinstance(self.dtype, torch.dtype) else _DTYPES[self.dtype]
