"""The worker side of KV transfer: a request's blocks of every layer copied out of the pool, or written into it, or
copied from block to block inside it.

The copy is the pool's own layout (`attention/kv_cache.py`), blocks selected along its block dimension: nothing is
repacked, so a decode engine takes the bytes only from a prefill engine of the same `KVLayout`. Out of the pool,
the blocks land on the host (the transports send host bytes); into it, they go to the pool's device.
"""

from __future__ import annotations

import torch

from services.worker.engine.attention.kv_cache import PAGED, KVCache


def block_dim(layout: str) -> int:
    """The dimension of a layer's K or V tensor that numbers its blocks in ``layout``."""
    return 0 if layout == PAGED else 1


def read_blocks(kv: KVCache, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``block_ids`` in every layer, on the host: ``[layers, *layer dims]`` with the block
    dimension cut to ``len(block_ids)`` (in that order)."""
    dim = block_dim(kv.layout)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv.keys[0].device)
    keys = torch.stack([layer.index_select(dim, index) for layer in kv.keys])
    values = torch.stack([layer.index_select(dim, index) for layer in kv.values])
    return keys.cpu(), values.cpu()


def write_blocks(kv: KVCache, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``read_blocks``'s tensors (from a pool of the same layout) into ``block_ids`` of every layer."""
    dim = block_dim(kv.layout)
    if keys.shape[0] != len(kv.keys) or keys.shape[dim + 1] != len(block_ids):
        raise ValueError(f"KV blocks of shape {tuple(keys.shape)} do not fit {len(block_ids)} blocks of this pool")
    device = kv.keys[0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    keys, values = keys.to(device, kv.keys[0].dtype), values.to(device, kv.values[0].dtype)
    for layer in range(len(kv.keys)):
        kv.keys[layer].index_copy_(dim, index, keys[layer])
        kv.values[layer].index_copy_(dim, index, values[layer])


def copy_blocks(kv: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy each ``(source, destination)`` block's keys and values in every layer (a pair of one block is a
    no-op); sources are read before any destination is written."""
    dim = block_dim(kv.layout)
    device = kv.keys[0].device
    sources = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
    destinations = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
    for layer in (*kv.keys, *kv.values):
        layer.index_copy_(dim, destinations, layer.index_select(dim, sources))
