"""KV blocks in memory: what one block holds (`KVShape`) and the per-layer tensors (`KVCache`) in the layout the
attention backend chose."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

HEAD_MAJOR = "head-major"
"""Per layer ``[kv_heads, num_blocks, block_size, head_dim]``: a gather of whole blocks is SDPA's ``[H, T, D]``."""
DIM_MAJOR_KEYS = "dim-major-keys"
"""Values head-major, keys ``[kv_heads, num_blocks, head_dim, block_size]`` (the CPU decode kernel's)."""
PAGED = "paged"
"""Per layer ``[num_blocks, block_size, kv_heads, head_dim]``: FlashAttention's page pool."""


@dataclass(frozen=True)
class KVShape:
    """What one KV block holds, from the model's text config."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        return cls.of_config(model.config)

    @classmethod
    def of_config(cls, config: Any) -> KVShape:
        """From a transformers config (its text config is used), without loading weights."""
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(int(text.num_hidden_layers), int(text.num_key_value_heads), int(head_dim))

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of one block over all layers (the same in every layout)."""
        return 2 * self.num_layers * block_size * self.kv_heads * self.head_dim * dtype.itemsize


@dataclass
class KVCache:
    """Per-layer K and V tensors of ``num_blocks`` blocks of ``block_size`` tokens in ``layout``.

    Invariant: allocated once, zeroed, never resized; a slot ``s`` is token ``s % block_size`` of block
    ``s // block_size`` in every layout.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    layout: str
    num_blocks: int
    block_size: int

    @staticmethod
    def allocate(
        shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, layout: str
    ) -> KVCache:
        heads, dim = shape.kv_heads, shape.head_dim
        dims = {
            HEAD_MAJOR: ((heads, num_blocks, block_size, dim), (heads, num_blocks, block_size, dim)),
            DIM_MAJOR_KEYS: ((heads, num_blocks, dim, block_size), (heads, num_blocks, block_size, dim)),
            PAGED: ((num_blocks, block_size, heads, dim), (num_blocks, block_size, heads, dim)),
        }
        if layout not in dims:
            raise ValueError(f"unknown KV layout {layout!r}")
        key_dims, value_dims = dims[layout]
        layers = range(shape.num_layers)
        return KVCache(
            keys=[torch.zeros(key_dims, dtype=dtype, device=device) for _ in layers],
            values=[torch.zeros(value_dims, dtype=dtype, device=device) for _ in layers],
            layout=layout,
            num_blocks=num_blocks,
            block_size=block_size,
        )
