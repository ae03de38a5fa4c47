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

    ``item_row`` is the row of the item's embedding that the span's first token takes: the span covers rows
    ``item_row .. item_row + num_tokens``. An item is one span at row 0, or, where the family writes text between
    parts of one item (Qwen3-VL's timestamps between a video's frame groups), several consecutive spans of one
    ``mm_hash``, the first at row 0 and each next at the previous one's ``item_row + num_tokens``; then each span's
    ``grid_thw`` is its own part's grid (positions), not the item's.
    """

    mm_hash: str
    offset: int
    num_tokens: int
    grid_thw: tuple[int, ...] = ()
    modality: str = "image"
    second_per_grid_t: float = 0.0
    item_row: int = 0

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offset + self.num_tokens

    @property
    def item_end(self) -> int:
        """One past the last embedding row of its item that it covers."""
        return self.item_row + self.num_tokens


def span_items(spans: list[MediaSpan]) -> list[int]:
    """The index of the item each span is part of: a span at ``item_row`` 0 starts the next item."""
    out: list[int] = []
    for span in spans:
        out.append(out[-1] + (span.item_row == 0) if out else 0)
    return out
