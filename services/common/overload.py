"""The two kinds of an encoder's refusal, as trailing metadata on RESOURCE_EXHAUSTED, for encoder and router.

`WAIT`: the expected wait for the request's items passes the encoder's time budget; the router
refuses its client at once. `FULL`: a count ceiling (preprocessing slots, queued tokens) binds
while the expected wait is short; the router may hold the request and try again after the hint.
"""

from __future__ import annotations

from collections.abc import Sequence

KIND_KEY = "epd-overload"
RETRY_AFTER_KEY = "retry-after-ms"
WAIT = "wait"
FULL = "full"


def trailing(retry_after_ms: int, kind: str) -> tuple[tuple[str, str], ...]:
    """The metadata an overloaded encoder attaches to its refusal."""
    return ((RETRY_AFTER_KEY, str(retry_after_ms)), (KIND_KEY, kind))


def read(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[int, str]:
    """(retry-after ms, kind) from a refusal's trailing metadata; a peer that sends no kind means `WAIT`."""
    values = dict(metadata or ())
    hint = values.get(RETRY_AFTER_KEY, "500")
    kind = values.get(KIND_KEY, WAIT)
    try:
        retry_ms = max(0, int(hint))
    except ValueError:
        retry_ms = 500
    return retry_ms, kind if kind in (WAIT, FULL) else WAIT
