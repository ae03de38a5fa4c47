"""Encoder settings (flags / EPD_* variables); see services/common/config.py for the rules."""

from __future__ import annotations

import dataclasses

from services.common.config import ServiceConfig, require_positive


@dataclasses.dataclass
class EncoderConfig(ServiceConfig):
    port: int = 50061
    max_encoder_tokens_per_batch: int = dataclasses.field(
        default=16384, metadata={"help": "vision tokens per tower call"})
    max_batch_wait_ms: float = dataclasses.field(default=5.0, metadata={"help": "wait to fill a batch"})
    max_image_pixels: int = dataclasses.field(default=50_000_000, metadata={"help": "pixels per image"})

    def validate(self) -> None:
        super().validate()
        require_positive("max_encoder_tokens_per_batch", self.max_encoder_tokens_per_batch)
