"""Content hashing for media items: the one place `mm_hash` is computed.

`mm_hash` is sha256 over length-prefixed fields, in this order: scheme version, model id,
model revision, the canonical JSON of every processor setting that changes the output, the
modality, and the item's raw bytes. Never the URL, never Python's `hash()`, never truncated.
Two items share a hash only if every one of those fields is byte-identical, so an embedding
keyed by it may be reused by any request of the same model revision.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MM_HASH_SCHEME = "epd-mm-v1"


@dataclass(frozen=True)
class ModelIdentity:
    """What an embedding depends on besides the item: the model and its processor settings."""

    model_id: str
    revision: str
    processor_settings: Mapping[str, Any]

    def settings_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace, so equal settings hash equally."""
        return canonical_json(self.processor_settings)

    @functools.cached_property
    def _fields(self) -> tuple[bytes, ...]:
        """The fields every item's hash starts with, encoded once (serialising the settings took most of an
        image's hashing time); plain bytes, so the identity still pickles."""
        return tuple(f.encode() for f in (MM_HASH_SCHEME, self.model_id, self.revision, self.settings_json()))


def canonical_json(value: Any) -> str:
    """Serialise `value` deterministically (sorted keys, compact separators)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"processor setting of type {type(value).__name__} is not JSON-serialisable")


def _update_field(digest: hashlib._Hash, field: bytes) -> None:
    digest.update(len(field).to_bytes(8, "big"))
    digest.update(field)


def mm_hash(identity: ModelIdentity, modality: str, data: bytes) -> str:
    """Return the full hex sha256 identifying `data` as a `modality` item for `identity`."""
    digest = hashlib.sha256()
    for field in (*identity._fields, modality.encode()):
        _update_field(digest, field)
    _update_field(digest, data)
    return digest.hexdigest()
