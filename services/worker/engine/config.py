"""Engine configuration: one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("auto", "cpu-kernel", "sdpa", "flash", "flash-reference")
CUDA_GRAPH_MODES = ("auto", "on", "off", "eager")
CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
"""The KV budget when ``kv_cache_bytes`` is 0 and the engine is not on CUDA."""


@dataclass
class EngineConfig:
    """Sizes and switches of one worker engine.

    ``kv_cache_bytes`` is the budget for the per-layer K and V block tensors; the number of blocks is
    derived from it and the model's shape. 0 (the default): on CUDA, what is left of
    ``gpu_memory_utilization`` x the device's memory after the weights, a warm-up step's peak and the
    embedding buffer; elsewhere ``CPU_KV_CACHE_BYTES``. ``block_size`` 0 (the default) takes the attention
    backend's (256 for ``flash``, whose paged kernel needs a multiple of 256; 16 otherwise). ``overcommit``
    scales how many blocks admitted requests may reserve against the total (1.0: never more than exist, so
    preemption never happens).

    ``prefill_tokens_per_free_seq`` (0: off) gives decodes priority to keep inter-token latency flat:
    a step takes at most ``max(block_size, prefill_tokens_per_free_seq x (max_num_seqs - decodes))``
    prefill tokens (tokens of chunks longer than one), so a step with many decoding sequences carries a
    small prefill chunk and one with few a large one; set it near (cost of a decode) / (cost of a prefill
    token), and a step costs about a full decode step at most.

    ``itl_target_ms`` (0: off) is an inter-token latency target: while sequences decode, each step carries the
    most prefill tokens the step-cost model (fitted online from the engine's own steps, ``step_cost.py``)
    predicts keep the step within it, at least one block's worth (``itl_target.py``); with both set, the
    smaller cap wins. With no decode running, prefill takes the whole budget either way.

    ``attention_backend`` names one of ``ATTENTION_BACKENDS`` (services/worker/engine/attention/): ``"auto"``
    picks ``flash`` on CUDA in float16/bfloat16, ``sdpa`` on CUDA otherwise, and on the CPU the
    compiled ``cpu-kernel`` where it applies (float32, 16-token blocks, head dims a multiple of 16, a C
    compiler) else ``sdpa``.

    ``cuda_graphs``: ``"auto"`` replays decode-only steps as CUDA graphs with ``flash`` on CUDA; ``"on"``
    captures with ``flash-reference`` too (which pads rows to ``max_model_len``: for checks with a short one);
    ``"off"`` never; ``"eager"`` runs the same padded static-buffer path without capturing (what the CPU tests
    use to prove the machinery).
    """

    block_size: int = 0
    kv_cache_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    cuda_graphs: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    overcommit: float = 1.0
    enable_prefix_caching: bool = True
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    prefill_tokens_per_free_seq: int = 0
    itl_target_ms: float = 0.0
    embedding_buffer_bytes: int = 256 * 1024 * 1024
    seed: int = 0
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("block_size", "kv_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0 (0: automatic), got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization must be within (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"EngineConfig.cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")
        if self.overcommit < 1.0:
            raise ValueError(f"EngineConfig.overcommit must be >= 1.0, got {self.overcommit}")
        if self.prefill_tokens_per_free_seq < 0:
            raise ValueError("EngineConfig.prefill_tokens_per_free_seq must be >= 0")
        if not self.itl_target_ms >= 0:
            raise ValueError(f"EngineConfig.itl_target_ms must be >= 0 (0: off), got {self.itl_target_ms}")
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
