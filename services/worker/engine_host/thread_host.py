"""The thread host: runs the engine on a thread of the worker process and feeds results back to asyncio.

The engine is not thread-safe; every call into it happens on this loop's thread. Other
threads submit commands (add, provide an embedding, abort), which run in order before the next step;
while sequences decode under an ITL target, for at most the engine's `command_budget_s` per gap between
steps (the rest run in the next gap).
Each request's outputs go to the sink given with it; the sink is dropped when the request
finishes (its last choice: `request_finished`) or is aborted, so no output is delivered after that.
An iteration's outputs (or a failure's Nones) reach their sinks through one `deliver` call, the whole
batch at once: a host that hands them to an event loop wakes it once per step, not once per sequence.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from services.common.priority import lower_priority
from services.worker.engine_host.host import Delivery, EngineLike, KVSnapshot, Sink, call_sinks

log = logging.getLogger(__name__)


class EngineLoop:
    """The thread host (`EngineHost`): the engine stepped on a thread of this process, commands queued to it."""

    def __init__(
        self,
        engine: EngineLike,
        idle_wait_s: float = 0.05,
        nice: int = 0,
        after_iteration: Callable[[], None] | None = None,
    ) -> None:
        self._nice = nice
        self._after_iteration = after_iteration  # on this thread, after each iteration's outputs and snapshot
        self._engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self.deliver: Delivery = call_sinks  # called on this loop's thread with each iteration's outputs
        self.deliver_kv: Callable[[list], None] | None = None  # with each step's KV chunks (a prefill worker's)
        self.finished_at: dict[str, float] = {}  # request id -> when its blocks were freed; popped by the server
        self._idle_wait_s = idle_wait_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.snapshot = KVSnapshot(engine.kv_state(), time.time())

    @property
    def kv_state(self) -> Any:
        return self.snapshot.state

    @property
    def step_costs(self) -> Any:
        return self._engine.step_costs

    @property
    def on_step(self) -> Callable[[Any], None] | None:
        return self._engine.on_step

    @on_step.setter
    def on_step(self, callback: Callable[[Any], None] | None) -> None:
        """Called on the engine thread with each timed step; set before `start`."""
        self._engine.on_step = callback

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    def add_request(self, request: Any, sink: Sink) -> None:
        def add() -> None:
            self._sinks[request.request_id] = sink
            self._engine.add_request(request)

        self._commands.put(add)

    def provide_embedding(self, mm_hash: str, tensor: Any, keep: bool = False) -> None:
        self._commands.put(lambda: self._engine.provide_embedding(mm_hash, tensor, keep))

    def forget_embedding(self, mm_hash: str) -> None:
        self._commands.put(lambda: self._engine.forget_embedding(mm_hash))

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Drop the request and its sink; the future holds whether the engine knew it."""

        def abort(engine: Any) -> bool:
            self._sinks.pop(request_id, None)
            return bool(engine.abort(request_id))

        return self.submit(abort)

    def submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread; the future holds its result or exception. A future its caller
        cancelled before the command ran (e.g. a cancelled gRPC call awaiting it through `asyncio.wrap_future`)
        runs nothing; once running it cannot be cancelled, so its result is always settable."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # cancelled while queued: nothing done, nothing to report
            try:
                future.set_result(fn(self._engine))
            except Exception as exc:  # handed to the caller, not the loop
                future.set_exception(exc)

        self._commands.put(run)
        return future

    def add_admitted(self, request: Any, sink: Sink, prepared: list | None = None) -> concurrent.futures.Future:
        """Reserve (every choice's blocks) and add in one engine-thread command (`engine.admit`: atomic with
        respect to other admissions); ``prepared``: `engine.prepare`'s sequences for it, made on another thread.

        The future's result is the admission time (worker clock; the sink is registered), None when refused;
        a request the engine rejects (ValueError) sets the exception and holds nothing.
        """

        def admit(engine: Any) -> float | None:
            if not engine.admit(request, prepared):
                return None
            self._sinks[request.request_id] = sink
            return time.time()  # reserved, before the snapshot that follows this command

        return self.submit(admit)

    def receive_kv(self, chunk: Any) -> concurrent.futures.Future:
        """A remote prefill's KV chunk for the engine (``engine.receive_kv``: checked and queued; the steps write it,
        and the first token, after the last chunk, reaches the request's sink as a step's outputs do)."""
        return self.submit(lambda engine: engine.receive_kv(chunk))

    def _dispatch(self, outputs: list) -> None:
        """Hand outputs to their requests' sinks in one delivery, dropping the sinks of finished requests."""
        batch = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.request_finished:
                self._sinks.pop(output.request_id, None)
                self.finished_at[output.request_id] = time.time()  # freed, before any later snapshot
            if sink is not None:
                batch.append((sink, output))
        if batch:
            self.deliver(batch)

    def _snapshot(self) -> None:
        at = time.time()
        self.snapshot = KVSnapshot(self._engine.kv_state(), at)  # one assignment: readers see a matching pair

    def _drain(self, block: bool) -> None:
        """Run the queued commands (waiting for one when `block`), for at most the engine's command budget
        (at least one command runs)."""
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        budget = self._engine.command_budget_s()
        deadline = None if budget is None else time.perf_counter() + budget
        command()
        while deadline is None or time.perf_counter() < deadline:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _run(self) -> None:
        lower_priority(self._nice)  # admission replies and heartbeats must not wait behind the model
        self._engine.bind_thread()
        while not self._stopped.is_set():
            try:
                self._drain(block=not self._engine.has_work())
                self._snapshot()  # admissions just made are visible before the (slow) step
                if self._engine.has_work():
                    outputs = self._engine.step()
                    if self.deliver_kv is not None and self._engine.kv_connector.outbox:
                        self.deliver_kv(self._engine.kv_connector.take())  # before the kv_sent outputs
                    self._dispatch(outputs)
                self._snapshot()
                if self._after_iteration is not None:
                    self._after_iteration()
            except Exception:  # a bug in one step must not kill the worker silently
                log.exception("engine step failed; failing the running requests")
                sinks, self._sinks = self._sinks, {}
                for request_id in sinks:
                    self._engine.abort(request_id)
                self.deliver([(sink, None) for sink in sinks.values()])
