"""The encoder's preprocessing cache: raw bytes + processor settings -> the sampled, resized frames.

Keyed by `preprocess_key` (sha256 over a scheme tag, the model's processor settings, the frame plan and
the item's bytes; not the model revision, so it outlives a weight update), it holds the video frames the
pool decoded and resized (`[T, H, W, 3]` uint8), so an item whose embedding is no longer cached (evicted,
another revision, another request's cache miss racing this one) skips decoding. It pays for video, where
decoding walks every frame up to the last sampled one; images are not cached here (their decode costs about
what a copy would).

Decisions: local to each encoder, no Redis tier. Placement hashing sends an `mm_hash` to the same encoder,
so repeats meet here; frames are 10-100x larger than the embedding they become, and the embedding cache
(memory and Redis) already shares the final product cluster-wide. Bounded in bytes (LRU); an item above a
quarter of the budget is not kept. Arrays handed out are shared: callers must not write to them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from services.models.base import VideoFramePlan

_SCHEME = b"epd-frames-v1"


def preprocess_key(settings_json: str, plan: VideoFramePlan, data: bytes) -> str:
    """The cache key of `data` decoded by `plan` under `settings_json` (the model's processor settings)."""
    digest = hashlib.sha256()
    for field in (_SCHEME, settings_json.encode(), repr(plan).encode(), data):
        digest.update(len(field).to_bytes(8, "big"))
        digest.update(field)
    return digest.hexdigest()


class PreprocessCache:
    """A thread-safe LRU of frame arrays bounded by `max_bytes` (0 disables it: every lookup misses).

    Invariant: the sum of the held arrays' `nbytes` never exceeds `max_bytes`. `on_event("hit" | "miss")`
    is called once per `get` (the metrics' hook).
    """

    def __init__(self, max_bytes: int, on_event: Callable[[str], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._on_event = on_event or (lambda kind: None)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            frames = self._entries.get(key)
            if frames is not None:
                self._entries.move_to_end(key)
        self._on_event("miss" if frames is None else "hit")
        return frames

    def put(self, key: str, frames: np.ndarray) -> bool:
        """Keep `frames` under `key` (evicting the least recently used); False when it is too large to keep."""
        size = int(frames.nbytes)
        if size > self.max_bytes // 4:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= int(old.nbytes)
            while self._entries and self._bytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= int(evicted.nbytes)
            self._entries[key] = frames
            self._bytes += size
        return True
