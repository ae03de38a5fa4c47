"""Worker settings (flags / EPD_* variables); see services/common/config.py for the rules."""

from __future__ import annotations

import dataclasses

from services.common.config import ConfigError, ServiceConfig, env_name, require_positive
from services.worker.engine.config import ATTENTION_BACKENDS, EngineConfig


@dataclasses.dataclass
class WorkerConfig(ServiceConfig):
    port: int = 50071
    kv_cache_bytes: int = dataclasses.field(
        default=0, metadata={"help": "KV cache budget; 0: from EPD_GPU_MEMORY_UTILIZATION on CUDA, 256 MiB on CPU"}
    )
    gpu_memory_utilization: float = dataclasses.field(
        default=0.9, metadata={"help": "share of GPU memory for weights, activations, embeddings and KV (CUDA)"}
    )
    block_size: int = dataclasses.field(
        default=0, metadata={"help": "tokens per KV block; 0: the attention backend's (256 for flash, else 16)"}
    )
    max_num_batched_tokens: int = dataclasses.field(default=2048, metadata={"help": "tokens per step"})
    max_num_seqs: int = dataclasses.field(default=64, metadata={"help": "sequences per step"})
    itl_target_ms: float = dataclasses.field(
        default=0.0,
        metadata={"help": "inter-token latency target: prefill per step sized to keep decode steps under it (0: off)"},
    )
    overcommit: float = dataclasses.field(default=1.0, metadata={"help": "reservable blocks / total (>= 1)"})
    enable_prefix_caching: bool = dataclasses.field(default=True, metadata={"help": "reuse cached KV blocks"})
    heartbeat_interval_s: float = dataclasses.field(default=0.2, metadata={"help": "registry heartbeat"})
    compute_nice: int = dataclasses.field(default=0, metadata={"help": "nice increment for the engine thread (0: off)"})
    max_image_pixels: int = dataclasses.field(default=50_000_000, metadata={"help": "pixels per co-located image"})
    embedding_timeout_s: float = dataclasses.field(default=60.0, metadata={"help": "wait per embedding"})
    attention_backend: str = dataclasses.field(
        default="auto", metadata={"help": "auto, cpu-kernel, sdpa, flash or flash-reference (docs/engine.md)"}
    )
    cuda_graphs: bool = dataclasses.field(
        default=True, metadata={"help": "replay decode-only steps as CUDA graphs (CUDA with flash backends)"}
    )
    engine_process: bool = dataclasses.field(
        default=False,
        metadata={"help": "run the engine in a child process with a GIL of its own (docs/engine.md)"},
    )

    def engine_config(self) -> EngineConfig:
        """The engine's settings among the worker's."""
        return EngineConfig(
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            itl_target_ms=self.itl_target_ms,
            overcommit=self.overcommit,
            enable_prefix_caching=self.enable_prefix_caching,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            cuda_graphs="auto" if self.cuda_graphs else "off",
        )

    def validate(self) -> None:
        super().validate()
        if self.overcommit < 1.0:
            raise ConfigError(f"EPD_OVERCOMMIT must be >= 1.0, got {self.overcommit}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "embedding_timeout_s"):
            require_positive(name, getattr(self, name))
        if not self.itl_target_ms >= 0:
            raise ConfigError(f"EPD_ITL_TARGET_MS must be >= 0 (0: off), got {self.itl_target_ms}")
        for name in ("kv_cache_bytes", "block_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{env_name(name)} must be >= 0 (0: automatic), got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"EPD_GPU_MEMORY_UTILIZATION must be within (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"EPD_ATTENTION_BACKEND must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
