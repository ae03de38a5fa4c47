"""Encoder settings (flags / EPD_* variables); see services/common/config.py for the rules.

Sizing: a request is admitted while the expected wait for its items, at the encoder's measured
throughput, stays within `encoder_max_queue_s` (and the request's deadline). `preprocess_workers`
processes decode images (0: one per core); at most `preprocess_queue` items wait for or run in them
(0: 128 per worker), and at most `max_queued_encoder_tokens` tokens are admitted but not yet through
the tower (0: 16 tower batches): ceilings for memory, sized so the time budget binds first in an
ordinary burst. Beyond any of these `Encode` answers RESOURCE_EXHAUSTED at once with a
`retry-after-ms` hint.
"""

from __future__ import annotations

import dataclasses
import os

from services.common.config import TRANSPORTS, ConfigError, ServiceConfig, env_name, require_choice, require_positive

DIST_BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass
class EncoderConfig(ServiceConfig):
    port: int = 50061
    max_encoder_tokens_per_batch: int = dataclasses.field(
        default=16384, metadata={"help": "vision tokens per tower call"}
    )
    max_batch_wait_ms: float = dataclasses.field(default=5.0, metadata={"help": "wait to fill a batch"})
    max_image_pixels: int = dataclasses.field(default=50_000_000, metadata={"help": "pixels per image"})
    max_video_frame_pixels: int = dataclasses.field(default=3840 * 2160, metadata={"help": "pixels per video frame"})
    video_decode_timeout_s: float = dataclasses.field(default=30.0, metadata={"help": "decode time per video"})
    preprocess_cache_bytes: int = dataclasses.field(
        default=256 << 20, metadata={"help": "sampled, resized video frames kept (0: off)"}
    )
    encoder_max_queue_s: float = dataclasses.field(
        default=20.0, metadata={"help": "longest expected wait admitted for a request's items"}
    )
    preprocess_workers: int = dataclasses.field(default=0, metadata={"help": "decode processes (0: cores)"})
    preprocess_queue: int = dataclasses.field(
        default=0, metadata={"help": "items decoding or waiting to (0: 128 per worker)"}
    )
    max_queued_encoder_tokens: int = dataclasses.field(
        default=0, metadata={"help": "tokens admitted, not yet encoded (0: 16 batches)"}
    )
    embedding_transport: str = dataclasses.field(
        default="grpc", metadata={"help": "push embeddings by grpc or dist (torch.distributed)"}
    )
    dist_backend: str = dataclasses.field(default="gloo", metadata={"help": "gloo (CPU) or nccl (GPU)"})
    transfer_timeout_s: float = dataclasses.field(default=30.0, metadata={"help": "per push, either transport"})
    inflight_lock_ttl_s: float = dataclasses.field(
        default=5.0,
        metadata={"help": "cluster-wide encode lock per mm_hash: how long waiters wait for a dead owner (renewed)"},
    )
    heartbeat_interval_s: float = dataclasses.field(default=0.2, metadata={"help": "registry heartbeat"})
    compute_nice: int = dataclasses.field(
        default=10, metadata={"help": "nice increment for decode, prepare and tower (0: off)"}
    )

    def validate(self) -> None:
        super().validate()
        for name in (
            "max_encoder_tokens_per_batch",
            "max_image_pixels",
            "transfer_timeout_s",
            "inflight_lock_ttl_s",
            "heartbeat_interval_s",
            "max_video_frame_pixels",
            "video_decode_timeout_s",
            "encoder_max_queue_s",
        ):
            require_positive(name, getattr(self, name))
        for name in (
            "max_batch_wait_ms",
            "preprocess_workers",
            "preprocess_queue",
            "max_queued_encoder_tokens",
            "compute_nice",
            "preprocess_cache_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{env_name(name)} must be >= 0, got {getattr(self, name)}")
        require_choice("embedding_transport", self.embedding_transport, TRANSPORTS)
        require_choice("dist_backend", self.dist_backend, DIST_BACKENDS)
        if self.preprocess_queue and self.preprocess_queue < self.workers:
            raise ConfigError(
                f"{env_name('preprocess_queue')} ({self.preprocess_queue}) must be at least "
                f"{env_name('preprocess_workers')} ({self.workers})"
            )

    @property
    def workers(self) -> int:
        """Decode processes actually started."""
        return self.preprocess_workers or max(1, os.cpu_count() or 1)

    @property
    def queue(self) -> int:
        """Items allowed in the preprocessing stage (running plus waiting)."""
        return self.preprocess_queue or 128 * self.workers

    @property
    def queued_token_cap(self) -> int:
        """Encoder tokens allowed between admission and the end of their tower call."""
        return self.max_queued_encoder_tokens or 16 * self.max_encoder_tokens_per_batch
