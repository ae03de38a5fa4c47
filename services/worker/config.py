"""Worker settings (flags / EPD_* variables); see services/common/config.py for the rules."""

from __future__ import annotations

import dataclasses

from services.common.config import ServiceConfig, require_positive


@dataclasses.dataclass
class WorkerConfig(ServiceConfig):
    port: int = 50071
    kv_cache_bytes: int = dataclasses.field(default=256 << 20, metadata={"help": "KV cache budget"})
    block_size: int = dataclasses.field(default=16, metadata={"help": "tokens per KV block"})
    max_num_batched_tokens: int = dataclasses.field(default=2048, metadata={"help": "tokens per step"})
    max_num_seqs: int = dataclasses.field(default=64, metadata={"help": "sequences per step"})
    embedding_timeout_s: float = dataclasses.field(default=60.0, metadata={"help": "wait per embedding"})

    def validate(self) -> None:
        super().validate()
        for name in ("kv_cache_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "embedding_timeout_s"):
            require_positive(name, getattr(self, name))
