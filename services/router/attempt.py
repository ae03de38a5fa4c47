"""One worker serving a request (an attempt): admission onto it, its encode task, a remote prefill, its chunks.

A request's router tries workers through `Attempts.run` until one serves it to the end (server.py migrates it
when one is lost). Invariants: the worker call and the encode task are cancelled and the vanished-watch withdrawn
on every exit path, which frees the worker's reservation; the admission's blocks are released exactly once, when
the attempt ends; a failure another worker may cure is WorkerLost (reason `PREFILL_LOST` when the remote prefill
failed: the next attempt prefills on its decode worker), any other is RequestError.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.grammar import constraint_of
from services.common.rpc.epd.v1 import worker_pb2
from services.common.tracing import tracer
from services.router.accounting import Accounted
from services.router.admission import Admission, Reserved
from services.router.cluster_view import ClusterView, WorkerView
from services.router.encode_dispatch import EncodeDispatcher, EncodeReport, Pending
from services.router.errors import RequestError
from services.router.metrics import RouterMetrics
from services.router.migration import VANISHED_AFTER_S, WorkerLost, lost_reason
from services.router.pd_choice import PrefillPlacement
from services.router.relay import Relays
from services.router.remote_prefill import PrefillFailed, RemotePrefill, receiving
from services.router.request_blocks import RequestBlocks
from services.router.request_record import admission_attributes, note_step, note_worker
from services.router.stream_state import StreamState
from services.router.worker_stream import RelayLostError, WorkerStream, open_worker

PREFILL_LOST = "prefill"  # a migration's reason when the remote prefill failed: the request is prefilled locally next


@dataclass
class Placed:
    """An admitted attempt: its decode worker's stream and, for a remote prefill, the prefill worker's view and the
    request as the decode worker got it (to receive its KV)."""

    stream: WorkerStream
    prefill: WorkerView | None = None
    request: worker_pb2.WorkerRequest | None = None


@dataclass
class StreamEnd:
    """How a worker stream ended: when the worker freed the request (its clock; 0 if unknown)."""

    released_at: float = 0.0


class Attempts:
    """This router's attempts: the admission, encode dispatch, prefill pairing and token relays they share."""

    def __init__(
        self,
        admission: Admission,
        dispatcher: EncodeDispatcher,
        metrics: RouterMetrics,
        view: ClusterView,
        channel: Callable[[str], grpc.aio.Channel],
        pairing: PrefillPlacement | None = None,
    ) -> None:
        self._admission = admission
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._view = view
        self._channel = channel
        self._pairing = pairing  # the (prefill, decode) pair of a request (router/pd_choice.py); None: always local
        self._remote_prefill = RemotePrefill(view, channel)
        self._prefills_left: set[asyncio.Task] = set()  # remote prefills awaiting their ack after their stream ended
        self.relays = Relays(channel)  # one token stream per worker for all of this router's requests

    async def close(self) -> None:
        """Close the relays (their streams' requests end with RelayLost)."""
        await self.relays.close()

    async def _open_worker(
        self,
        worker: str,
        request: worker_pb2.WorkerRequest,
        blocks: RequestBlocks,
        deadline: float,
        local: bool,
    ) -> Reserved[Placed] | None:
        """Admission's try of `worker`: when the pairing picks a prefill worker for it (`local` False), `worker` is
        the decode side and admits the request to receive its KV; otherwise it prefills the request itself."""
        prefill = None
        decode = None if local or self._pairing is None else self._view.worker(worker)
        if decode is not None:
            transferable = request.sampling.n <= 1 and constraint_of(request.sampling) is None
            prefill = self._pairing.prefill_for(blocks, decode, transferable=transferable)
        if prefill is not None:
            request = receiving(request)
        reserved = await open_worker(self._channel(worker), worker, request, deadline, self.relays.ready(worker))
        if reserved is None:
            return None
        return Reserved(Placed(reserved.handle, prefill, request if prefill is not None else None), reserved.at)

    async def run(
        self,
        worker_request: worker_pb2.WorkerRequest,
        accounted: Accounted,
        deadline: float,
        state: StreamState,
        sources: list[str],
        pending: Pending,
        local: bool = False,
    ):
        """One worker serving the request: admission, the encode task, the stream; the client's responses, each a
        chunk (`sources`: its media's `media_sources` keys, remembered once their embeddings are cached; `pending`:
        what `precheck` counted for them, settled by `check_room`). With a remote
        prefill (placement paired the worker with a prefill worker; never when `local`) the embeddings go to the
        prefill worker and a task runs its prefill, whose failure cancels the stream (WorkerLost, reason
        PREFILL_LOST). Raises WorkerLost when the worker fails in a way another worker may cure."""
        blocks = RequestBlocks.for_prompt(
            list(worker_request.token_ids),
            accounted.projected_tokens,
            accounted.media_spans(),
            worker_request.cache_salt,
            accounted.n,
        )
        items = await self._dispatcher.uncached(list(accounted.refs), accounted.item_data)
        note_step("lookup")
        if len(sources) == len(accounted.refs):  # the found ones are let by `precheck` from now on
            missing = {item.ref.mm_hash for item in items}
            found = [key for key, ref in zip(sources, accounted.refs, strict=True) if ref.mm_hash not in missing]
            self._dispatcher.remember(found)
        booking = self._dispatcher.check_room(items, pending)  # no room: refused before a worker reserves
        try:
            with tracer().start_as_current_span("admission") as placing:  # the worker call opened here is its child
                admitted = await self._admission.admit(
                    blocks, lambda worker: self._open_worker(worker, worker_request, blocks, deadline, local), deadline
                )
                placing.set_attributes(admission_attributes(admitted))
        except BaseException:
            self._dispatcher.release(booking)  # its items go to no encoder
            raise
        note_worker(admitted.worker)
        note_step("placed")
        self._metrics.queue_seconds.record(admitted.queue_s)
        state.queue_s += admitted.queue_s
        placed: Placed = admitted.handle
        call = placed.stream
        prefill = None
        destination = admitted.worker
        if placed.prefill is not None:  # remote prefill: the embeddings go to the prefill worker
            destination = placed.prefill.address
            run = self._remote_prefill.run(
                destination, placed.prefill.block_size, placed.request, admitted.worker, call.kv_skip_blocks, deadline
            )
            prefill = asyncio.create_task(run, name=destination)  # named after its prefill worker
            prefill.add_done_callback(lambda task: self._prefill_done(task, call))
        if items:
            encode = asyncio.create_task(
                self._dispatcher.encode_items(worker_request.request_id, items, destination, deadline, booking)
            )
        else:  # nothing to encode (text, or every item cached): its empty report at once, no task
            encode = asyncio.get_running_loop().create_future()
            encode.set_result(EncodeReport())
        encode.add_done_callback(lambda task: task.cancelled() or task.exception() is None or call.cancel())
        encode.add_done_callback(lambda task: self._record_encode(task, state, sources))
        vanished = asyncio.Event()
        unwatch = self._view.on_absent(admitted.worker, VANISHED_AFTER_S, lambda: (vanished.set(), call.cancel()))
        end = StreamEnd()
        served = False
        try:
            stream = self._stream(call, admitted.worker, encode, vanished, state, end, prefill, deadline)
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    yield response
            served = True
        finally:
            unwatch()
            call.cancel()
            encode.cancel()
            if prefill is not None and not prefill.done():
                if served:  # the tokens came, so the KV did: let the prefill worker's call end on its ack
                    self._prefills_left.add(prefill)
                    prefill.add_done_callback(self._prefills_left.discard)
                else:
                    prefill.cancel()
            self._admission.released(admitted.worker, admitted.blocks, end.released_at)

    def _prefill_done(self, task: asyncio.Task, call: WorkerStream) -> None:
        """A remote prefill ended: counted by outcome; a failure cancels the decode side's stream (`_stream` then
        raises WorkerLost for the prefill worker)."""
        outcome = "cancelled" if task.cancelled() else "failed" if task.exception() is not None else "sent"
        self._metrics.remote_prefills.add(1, {"outcome": outcome})
        if outcome == "failed":
            call.cancel()

    def _record_encode(self, task: asyncio.Future, state: StreamState, sources: list[str]) -> None:
        """Encode time of the items sent to encoders (the task may end after the last token); the request's
        media are cached from now on."""
        if not task.cancelled() and task.exception() is None:
            self._dispatcher.remember(sources)
        if not task.cancelled() and task.exception() is None and task.result().seconds > 0:
            self._metrics.encode_seconds.record(task.result().seconds)
            state.encode_s += task.result().seconds
            state.encode_stages.MergeFrom(task.result().stages)  # a migration's encode: the later one's stages

    async def _stream(
        self,
        call: WorkerStream,
        worker: str,
        encode: asyncio.Future,
        vanished: asyncio.Event,
        state: StreamState,
        end: StreamEnd,
        prefill: asyncio.Task | None = None,
        deadline: float = float("inf"),
    ):
        """The worker's responses as the client's (each a chunk) until every choice is done or the stream ends.
        `prefill`: the remote prefill's task, whose failure, or the decode worker's deadline for its KV, is
        WorkerLost of the prefill worker (the next attempt prefills locally)."""
        answered = False  # a response of this attempt arrived (after a remote prefill: its KV did)
        try:
            while (response := await call.read()) is not None:
                answered = True
                end.released_at = response.state_at or end.released_at  # set on the worker's last message only
                out = state.take(response, self._metrics)
                if out is not None:
                    yield out
                if state.choices.done:  # every choice finished, or ended here at a stop string
                    break
        except RelayLostError as exc:
            raise WorkerLost(worker, "relay", str(exc)) from None
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if prefill is not None and prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
                failed = prefill.exception()
                worker_name = failed.worker if isinstance(failed, PrefillFailed) else worker
                raise WorkerLost(worker_name, PREFILL_LOST, str(failed)) from None
            if (
                prefill is not None
                and isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                and not answered  # before its first token: the KV is what it waited for
                and time.monotonic() < deadline
            ):  # the decode worker's deadline for the KV passed (EPD_KV_TRANSFER_TIMEOUT_S), not the request's;
                prefill.cancel()  # a prefill still running is given up (one that ended late was dropped there)
                raise WorkerLost(prefill.get_name(), PREFILL_LOST, f"its KV did not arrive: {exc.details()}") from None
            if vanished.is_set():
                raise WorkerLost(worker, "vanished", "missing from the registry") from None
            if encode.done() and not encode.cancelled() and encode.exception() is not None:
                error = encode.exception()
                if isinstance(error, RequestError) and error.code == grpc.StatusCode.UNAVAILABLE:
                    if prefill is not None:  # the embeddings went to the prefill worker: it is the one gone
                        raise WorkerLost(prefill.get_name(), PREFILL_LOST, f"encode: {error.message}") from None
                    raise WorkerLost(worker, "encode", error.message) from None  # e.g. the push found it gone
                raise error from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            reason = lost_reason(exc)
            if reason is not None:
                raise WorkerLost(worker, reason, f"{exc.code().name}: {exc.details()}") from exc
            raise RequestError(exc.code(), f"worker {worker}: {exc.details()}") from exc
