"""The one block-hash function shared by the router and the worker.

A prompt is cut into blocks of ``block_size`` tokens. Each full block gets a sha256 chained over
``(parent hash, token ids, extra keys)`` starting from a fixed root. The extra keys are
``(mm_hash, offset in item)`` for every media span overlapping the block (the offset counts the item's rows
before the span: ``item_row``), so two prompts with the same
placeholder tokens but different images never share the blocks from that image on; ``cache_salt`` is
folded into block 0 only, so different tenants share nothing. Fields are length-prefixed; Python's
``hash()`` is never used, so every process computes the same bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from services.models.media_span import MediaSpan

HASH_SCHEME = b"epd-block-hash-v1"
ROOT_HASH: bytes = hashlib.sha256(HASH_SCHEME).digest()


@dataclass(frozen=True)
class ExtraKey:
    """A media item overlapping a block, and the index inside the item (its embedding row) where the overlap starts."""

    mm_hash: str
    offset_in_item: int


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _packed(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def block_extra_keys(start: int, end: int, media: Sequence[MediaSpan]) -> list[ExtraKey]:
    """Extra keys for the block of tokens ``[start, end)``: one per overlapping media span, in order."""
    keys = []
    for item in media:
        if item.offset < end and start < item.end:
            keys.append(ExtraKey(item.mm_hash, item.item_row + max(start - item.offset, 0)))
    return keys


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey], cache_salt: str = "") -> bytes:
    """sha256 of one block chained to ``parent``; pass ``cache_salt`` for block 0 only."""
    return _hash_packed(parent, _packed(token_ids), extra_keys, cache_salt)


def _hash_packed(parent: bytes, packed_tokens: bytes, extra_keys: Sequence[ExtraKey], cache_salt: str) -> bytes:
    """`hash_block` of a block whose token ids are already packed (`_packed`): the one layout of the hashed bytes,
    hashed in one call (a prompt's blocks are hashed on every request the router places)."""
    fields = [_field(parent), _field(packed_tokens), struct.pack("<Q", len(extra_keys))]
    for key in extra_keys:
        fields += (_field(key.mm_hash.encode()), struct.pack("<Q", key.offset_in_item))
    fields.append(_field(cache_salt.encode()))
    return hashlib.sha256(b"".join(fields)).digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    media: Sequence[MediaSpan] = (),
    cache_salt: str = "",
) -> list[bytes]:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` not hashed yet; returns it.

    ``hashes`` holds the hashes of the first ``len(hashes)`` blocks of the same token list, so a
    sequence that grows by decoding hashes each block once.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    first, full = len(hashes), len(token_ids) // block_size
    if first >= full:
        return hashes
    packed = _packed(token_ids[first * block_size : full * block_size])  # every new block's ids packed at once
    width = 4 * block_size
    # `_hash_packed`'s layout with its constant fields made once: a parent is always a 32-byte digest, a block is
    # `width` bytes, and a block with no media has no keys and (past block 0) an empty salt
    parent_length, block_length, no_keys = struct.pack("<Q", 32), struct.pack("<Q", width), struct.pack("<Q", 0)
    salt_first, salt_none = _field(cache_salt.encode()), _field(b"")
    parent = hashes[-1] if hashes else ROOT_HASH
    for index in range(first, full):
        block = packed[(index - first) * width : (index - first + 1) * width]
        keys = block_extra_keys(index * block_size, (index + 1) * block_size, media) if media else ()
        if keys:
            parent = _hash_packed(parent, block, keys, cache_salt if index == 0 else "")
        else:
            salt = salt_first if index == 0 else salt_none
            parent = hashlib.sha256(b"".join((parent_length, parent, block_length, block, no_keys, salt))).digest()
        hashes.append(parent)
    return hashes


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, media: Sequence[MediaSpan] = (), cache_salt: str = ""
) -> list[bytes]:
    """Hashes of every full block of a prompt (a trailing partial block has none)."""
    return extend_block_hashes([], token_ids, block_size, media, cache_salt)
