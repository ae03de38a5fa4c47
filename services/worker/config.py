"""Worker settings (flags / EPD_* variables); see services/common/config.py for the rules."""

from __future__ import annotations

import dataclasses

from services.common.config import ConfigError, ServiceConfig, require_positive
from services.worker.engine.config import ATTENTION_BACKENDS


@dataclasses.dataclass
class WorkerConfig(ServiceConfig):
    port: int = 50071
    kv_cache_bytes: int = dataclasses.field(default=256 << 20, metadata={"help": "KV cache budget"})
    block_size: int = dataclasses.field(default=16, metadata={"help": "tokens per KV block"})
    max_num_batched_tokens: int = dataclasses.field(default=2048, metadata={"help": "tokens per step"})
    max_num_seqs: int = dataclasses.field(default=64, metadata={"help": "sequences per step"})
    overcommit: float = dataclasses.field(default=1.0, metadata={"help": "reservable blocks / total (>= 1)"})
    enable_prefix_caching: bool = dataclasses.field(default=True, metadata={"help": "reuse cached KV blocks"})
    heartbeat_interval_s: float = dataclasses.field(default=0.2, metadata={"help": "registry heartbeat"})
    compute_nice: int = dataclasses.field(
        default=0, metadata={"help": "nice increment for the engine thread (0: off)"})
    max_image_pixels: int = dataclasses.field(default=50_000_000, metadata={"help": "pixels per co-located image"})
    embedding_timeout_s: float = dataclasses.field(default=60.0, metadata={"help": "wait per embedding"})
    attention_backend: str = dataclasses.field(
        default="auto", metadata={"help": "decode attention: auto (CPU kernel where it applies) or sdpa"})

    def validate(self) -> None:
        super().validate()
        if self.overcommit < 1.0:
            raise ConfigError(f"EPD_OVERCOMMIT must be >= 1.0, got {self.overcommit}")
        for name in ("kv_cache_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "embedding_timeout_s"):
            require_positive(name, getattr(self, name))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"EPD_ATTENTION_BACKEND must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
