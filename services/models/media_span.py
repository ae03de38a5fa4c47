"""Where a media item sits in a prompt (`MediaSpan`): the one type for it in every service, proto aside.

Below the services and free of torch: the router's accounting and block hashes, the worker engine's
sequences, embeddings and positions, and the adapters' prompts and positions all use it; the proto's
`MediaRef` becomes one and back only at the gRPC edges (services/common/media_refs.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One media item's placeholder tokens, ``token_ids[offset:offset + num_tokens]``, and what positions need.

    ``mm_hash`` is the item's content hash (services/common/hashing.py); it is empty in the spans of a prompt
    an adapter has just built, until the router hashes the items. ``grid_thw`` is the model's patch grid for
    positions (empty where the family does not use it); ``modality`` names the placeholder token the item
    covers; ``second_per_grid_t`` is a video's seconds per temporal grid step (Qwen2.5-VL; 0.0 if unused).
    """

    mm_hash: str
    offset: int
    num_tokens: int
    grid_thw: tuple[int, ...] = ()
    modality: str = "image"
    second_per_grid_t: float = 0.0

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offset + self.num_tokens
