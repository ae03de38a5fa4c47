"""What can end a request's output queue besides the engine's outputs, and the gRPC status each one answers.

Invariant: every marker ends the request's Generate stream with a status its router acts on: UNAVAILABLE (the
router migrates the request: this worker's drain timeout, its relay closing), DEADLINE_EXCEEDED (an embedding or a
remote prefill's KV that never came) or INTERNAL (a failed engine step, queued as None).
"""

from __future__ import annotations

import dataclasses

import grpc

from services.worker.relay import RelayClosed

DRAIN_METADATA = (("epd-migrate-reason", "drain"),)


@dataclasses.dataclass(frozen=True)
class FetchFailed:
    """An embedding the request needs (or a remote prefill's KV) did not arrive in time."""

    message: str


@dataclasses.dataclass(frozen=True)
class Drained:
    """The worker is shutting down and ends the request (the router migrates it)."""


def ending(last: object, worker: str) -> tuple[grpc.StatusCode, str, tuple] | None:
    """The status, message and trailing metadata that `last`, off the queue of a request on `worker`, ends its
    stream with; None for an engine output (the stream goes on, or ends by itself)."""
    if isinstance(last, Drained):
        return grpc.StatusCode.UNAVAILABLE, f"worker {worker} shut down (drain timeout)", DRAIN_METADATA
    if isinstance(last, FetchFailed):
        return grpc.StatusCode.DEADLINE_EXCEEDED, last.message, ()
    if isinstance(last, RelayClosed):
        return grpc.StatusCode.UNAVAILABLE, f"relay {last.relay_id} closed", ()
    if last is None:
        return grpc.StatusCode.INTERNAL, "engine step failed; see worker log", ()
    return None
