"""Mid-stream migration: when a request's worker fails, the request continues on another worker.

The rule (docs/reliability.md): the router keeps every token id each choice has streamed. When the worker
stream fails (connection lost, UNAVAILABLE, INTERNAL or UNKNOWN, a draining worker ending it, the encode
failing because the worker cannot be reached, or the worker missing from the registry for `VANISHED_AFTER_S`;
the metric's reasons: unavailable, internal, unknown, drain, encode, vanished), the request is admitted again
as a continuation: the prompt followed by the tokens streamed so far, `max_tokens` less those, the same
sampling otherwise. Its embeddings reach the new worker through the encode dispatch again (cached items skip
the encoder). The client's stream goes on from the same output state (detokenizer, stop strings): no gap, no
duplicate. Seeded sampling continues deterministically because a token's draw depends only on the seed and its
position (services/worker/engine/sampler.py, `position_seed`). A request of n > 1 choices moves only before
its first token (its choices have diverged after that).

Invariant: a request migrates at most `limit` times (EPD_MIGRATION_LIMIT); the next failure ends it with
UNAVAILABLE naming the worker and the count. Each migration is counted once, by reason, in
`epd_migrations_total{reason}` and in the final usage (`Usage.migrations`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from services.common.rpc.epd.v1 import worker_pb2
from services.router.errors import RequestError, unavailable

# Worker stream failures a continuation may cure, as the metric's reason label.
MIGRATABLE = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.INTERNAL: "internal",
    grpc.StatusCode.UNKNOWN: "unknown",
}
VANISHED_AFTER_S = 3.0  # a worker missing from the registry this long (while Redis answers) is gone


class WorkerLost(Exception):
    """The worker stream of an admitted request failed in a way another worker may cure."""

    def __init__(self, worker: str, reason: str, detail: str) -> None:
        super().__init__(f"worker {worker} failed ({reason}): {detail}")
        self.worker = worker
        self.reason = reason
        self.detail = detail


def lost_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """The reason label when `exc` (from a worker stream) is a failure to migrate; None when it is final."""
    metadata = dict(exc.trailing_metadata() or ())
    if metadata.get("epd-migrate-reason") == "drain":
        return "drain"
    return MIGRATABLE.get(exc.code())


@dataclass
class Progress:
    """The token ids each choice has streamed to the client so far (what a continuation re-sends)."""

    n: int
    tokens: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(max(self.n, 1))]

    def add(self, index: int, token_ids: Iterable[int]) -> None:
        self.tokens[index].extend(token_ids)

    @property
    def streamed(self) -> int:
        return sum(len(t) for t in self.tokens)


def continuation(base: worker_pb2.WorkerRequest, progress: Progress, attempt: int) -> worker_pb2.WorkerRequest:
    """The worker request for `attempt` (0: the original): the prompt plus the tokens streamed, the remaining
    max_tokens, a fresh request id (the failed worker may still hold the old one). Only for a request that
    can move (`Migrations.next` said so): one choice, or nothing streamed yet."""
    request = worker_pb2.WorkerRequest()
    request.CopyFrom(base)
    if attempt == 0:
        return request
    request.request_id = f"{base.request_id}~m{attempt}"
    if progress.streamed == 0:
        return request
    generated = progress.tokens[0]
    request.token_ids.extend(generated)
    request.generated_tokens = len(generated)
    request.sampling.max_tokens = base.sampling.max_tokens - len(generated)
    return request


@dataclass
class Migrations:
    """One request's migrations: at most `limit`, each reported through `count(reason)` (the metric)."""

    limit: int
    count: Callable[[str], None]
    done: int = 0

    def next(self, lost: WorkerLost, progress: Progress) -> None:
        """Allow one more migration after `lost`, or raise UNAVAILABLE naming the worker and the count (past
        the limit, or for a request of several choices whose tokens have started to stream)."""
        if progress.streamed and len(progress.tokens) > 1:
            raise unavailable(
                f"worker {lost.worker} failed ({lost.reason}: {lost.detail}); a request of "
                f"n={len(progress.tokens)} choices cannot move once its tokens have streamed"
            )
        if self.done >= self.limit:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {lost.worker} failed ({lost.reason}: {lost.detail}); the request already moved "
                f"{self.done} time(s), the limit (EPD_MIGRATION_LIMIT) is {self.limit}",
            )
        self.done += 1
        self.count(lost.reason)
