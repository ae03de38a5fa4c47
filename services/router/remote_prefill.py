"""A request's remote prefill: the prefill worker's Generate call that computes its prompt KV and pushes it to the
decode worker that admitted it.

Order (docs/disaggregation.md): admission reserves the request on its decode worker first, as a `receive` request
(`receiving`: it fetches no embeddings and waits for its KV); that worker's `admitted` answer says how many leading
prompt blocks it already holds. `RemotePrefill.run` then sends the prefill worker the same request as `send`
(`sending`: the decode worker's address as peer, those blocks to skip, `max_tokens` 1, since a prefill worker
reserves only the prompt and the token it samples), holding that many blocks in the router's view of the prefill
worker while it runs, and returns when the prefill worker answers `kv_sent` (the decode worker acknowledged every
block). Any other end raises `PrefillFailed` naming the prefill worker: a refusal (full, draining), the worker
unreachable or dead, a failed push, the call's deadline; the caller then cancels the decode side and re-admits the
request to prefill locally. Cancelling `run` cancels the call, which aborts the prefill there (its blocks freed);
the decode worker drops any chunk that arrives for a request no longer receiving.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from services.common.kv_blocks import blocks_for
from services.common.rpc.epd.v1 import worker_pb2, worker_pb2_grpc
from services.common.tracing import tracer
from services.router.cluster_view import ClusterView

KV_SENT = "kv_sent"  # a prefill worker's end of a request whose KV its decode worker acknowledged


class PrefillFailed(Exception):
    """A remote prefill did not deliver: ``worker`` (the prefill worker) and what happened."""

    def __init__(self, worker: str, detail: str) -> None:
        super().__init__(f"remote prefill on {worker} failed: {detail}")
        self.worker = worker
        self.detail = detail


def receiving(request: worker_pb2.WorkerRequest) -> worker_pb2.WorkerRequest:
    """The decode worker's copy of ``request``: admitted to receive its prompt KV from a prefill worker."""
    out = worker_pb2.WorkerRequest()
    out.CopyFrom(request)
    out.kv_transfer.direction = "receive"
    return out


def sending(request: worker_pb2.WorkerRequest, decode: str, skip_blocks: int) -> worker_pb2.WorkerRequest:
    """The prefill worker's copy of ``request``: prefill, sample one token, push the KV past ``skip_blocks`` leading
    blocks to ``decode``. No relay: it streams no tokens to the router."""
    out = worker_pb2.WorkerRequest()
    out.CopyFrom(request)
    out.relay_id = ""
    out.sampling.max_tokens = 1
    out.kv_transfer.direction, out.kv_transfer.peer, out.kv_transfer.skip_blocks = "send", decode, skip_blocks
    return out


class RemotePrefill:
    """Runs remote prefills on the prefill workers (see the module docstring); ``channel(address)`` dials one."""

    def __init__(self, view: ClusterView, channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._view = view
        self._channel = channel

    async def run(
        self, prefill: str, block_size: int, request: worker_pb2.WorkerRequest, decode: str, skip_blocks: int,
        deadline: float,
    ) -> None:  # fmt: skip
        """Prefill ``request`` (the decode worker's, `receiving`) on ``prefill`` for ``decode``; returns once its KV
        is acknowledged there, raises PrefillFailed otherwise."""
        send = sending(request, decode, skip_blocks)
        need = blocks_for(len(send.token_ids) + 1, block_size)
        hold = self._view.hold(prefill, need)
        admitted = False
        released_at = 0.0
        with tracer().start_as_current_span("kv_transfer") as span:
            span.set_attributes(
                {"epd.prefill_worker": prefill, "epd.decode_worker": decode, "epd.skip_blocks": skip_blocks}
            )
            timeout = max(0.001, deadline - time.monotonic())
            call = worker_pb2_grpc.WorkerStub(self._channel(prefill)).Generate(send, timeout=timeout)
            try:
                async for response in call:
                    if response.admitted and not admitted:
                        admitted = True
                        self._view.confirm(hold, response.state_at)
                    released_at = response.state_at or released_at
                    if response.finish_reason == KV_SENT:
                        return
                    if response.finished:
                        raise PrefillFailed(prefill, f"it ended {response.finish_reason!r}, not {KV_SENT!r}")
                raise PrefillFailed(prefill, "its stream ended before the KV was sent")
            except grpc.aio.AioRpcError as exc:
                raise PrefillFailed(prefill, f"{exc.code().name}: {exc.details()}") from None
            finally:
                call.cancel()
                if admitted:
                    self._view.note_released(prefill, need, released_at)
                else:
                    self._view.drop(hold)
