"""The `flash-reference` backend: `flash`'s metadata, KV layout and call, with the pure-torch `varlen_attn` twin.

Runs on any device and dtype with any block size: on the CPU it proves what the GPU runs (tests), and on
CUDA it serves where the kernel cannot (float32, or a torch without a paged `varlen_attn`).
"""

from __future__ import annotations

from services.models.varlen_attention import varlen_attn_reference
from services.worker.engine.attention.varlen import VarlenBackend


class FlashReferenceBackend(VarlenBackend):
    name = "flash-reference"

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size, varlen_attn_reference)
