"""The process host: the engine in a process of its own (`EPD_ENGINE_PROCESS`), an `EngineHost` as `EngineLoop` is.

Why: in one process the engine thread shares the GIL with the worker's event loop and gRPC's poller thread.
A CPU step is some hundred torch ops, each releasing the GIL and taking it back, and every message the event
loop relays (a write, its completion) takes it in between: timed with the thread's scheduler statistics, a
worker's steps spent 1.5-1.8 ms each (a third of a quiet decode step) and up to 4.4 ms in a burst waiting for
the GIL, neither computing nor waiting for a core. In a child process the engine has a GIL of its own, as
vLLM's engine core does.

The parent (`EngineProcess`) forks the child when the worker may (services/worker/engine_host/fork.py: the child
inherits the imported modules) and spawns it otherwise (a fresh interpreter); the child loads the model and runs
an `EngineLoop`; the two speak over one pipe. Down: admissions, embeddings (through shared memory), aborts,
co-located encodes. Up, once per engine-loop iteration that changed something: the step's outputs per request,
when finished requests freed their blocks, the KV snapshot, the timed steps and the fitted step-cost
coefficients. A reader thread in the parent hands outputs to the sinks and the timings to `on_step`. If the
child dies, every running request's sink gets None (the worker answers INTERNAL, the router migrates) and
`on_lost` runs (the worker exits, its supervisor restarts it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from services.worker.config import WorkerConfig
from services.worker.engine.step_cost import DEFAULT_PRIOR, StepTiming
from services.worker.engine_host.child import child_main
from services.worker.engine_host.fork import signals_blocked
from services.worker.engine_host.host import Delivery, KVSnapshot, Sink, call_sinks
from services.worker.engine_host.pipe import Abort, Admit, Embedding, Encode, Failed, Forget, Ready, Reply, Stop, Update

log = logging.getLogger(__name__)


class EngineGone(RuntimeError):
    """The engine process has exited (or was stopped): nothing more can run on this worker."""


@dataclasses.dataclass
class StepCosts:
    """The child's fitted step-cost coefficients as last reported (what the metrics read of a `StepCostModel`)."""

    coefficients: tuple[float, ...] = DEFAULT_PRIOR


@dataclasses.dataclass(frozen=True)
class EncodedEmbeddings:
    """A co-located encode's result, as `VisionRunner.encode`'s (what `LocalEncoderServicer` reads)."""

    embeddings: list[torch.Tensor]


class EngineProcess:
    """`EngineLoop`'s interface over an engine in a child process. Invariant: a request's sink is registered
    before its admission is sent and dropped when its last output, a failure, a refusal or an abort is seen, so
    no output reaches a sink after that; every future handed out completes (with an error if the child dies)."""

    def __init__(self, config: WorkerConfig, on_lost: Callable[[], None] | None = None) -> None:
        self._config = config
        self._on_lost = on_lost or _exit_soon
        self._conn, self._child_conn = multiprocessing.Pipe()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # sinks and replies: the event loop adds, the reader thread takes
        self._sinks: dict[str, Sink] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._ready = threading.Event()
        self._failure = ""
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self.snapshot: KVSnapshot | None = None
        self.finished_at: dict[str, float] = {}  # request id -> when its blocks were freed; popped by the server
        self.step_costs = StepCosts()
        self.on_step: Callable[[StepTiming], None] | None = None
        self.deliver: Delivery = call_sinks  # called on the reader thread with each update's outputs, at once

    @property
    def kv_state(self) -> Any:
        return self.snapshot.state

    @property
    def pid(self) -> int | None:
        """The child's process id (None before start)."""
        return None if self._process is None else self._process.pid

    def launch(self, fork: bool = False) -> None:
        """Start the child, not waiting for it: forked when `fork` (the caller checked `fork.may_fork()`: the child
        inherits the imported modules), else spawned. Idempotent."""
        if self._process is not None:
            return
        if fork:
            context = multiprocessing.get_context("fork")
            target, args = _forked_child_main, (self._conn, self._child_conn, self._config)
        else:
            context = multiprocessing.get_context("spawn")
            target, args = child_main, (self._child_conn, self._config)
        self._process = context.Process(target=target, args=args, name="epd-engine", daemon=True)
        with signals_blocked():
            self._process.start()
        self._child_conn.close()
        self._reader.start()
        log.info("engine process %d %s", self._process.pid, "forked" if fork else "spawned")

    def start(self, timeout_s: float | None = None) -> None:
        """Launch the child (spawned, unless `launch` forked it already) and wait until its model is loaded;
        RuntimeError (with the child's reason) if it fails."""
        self.launch()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready.wait(0.5):
            if not self._process.is_alive():
                self._reader.join(timeout=5)  # it reads the child's reason, if it sent one, then sees the pipe close
                break
            if deadline is not None and time.monotonic() > deadline:
                self._failure = f"not ready within {timeout_s:.0f} s"
                break
        if not self._ready.is_set():
            self._failure = self._failure or f"exit code {self._process.exitcode}"
            self.stop()
            raise RuntimeError(f"the engine process failed to start: {self._failure}")

    def stop(self) -> None:
        self._stopping = True
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(OSError):  # the child may be going already
                self._send(Stop())
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
        if self._reader.is_alive():
            self._reader.join(timeout=5)  # the child is gone: the pipe is at its end
        self._conn.close()

    def add_admitted(self, request: Any, sink: Sink) -> concurrent.futures.Future:
        """As `EngineLoop.add_admitted`: the future holds the admission time, None when refused, or the
        engine's ValueError."""
        with self._lock:
            self._sinks[request.request_id] = sink
        future = self._call(lambda token: Admit(token, request))
        future.add_done_callback(functools.partial(self._admitted, request.request_id))
        return future

    def _admitted(self, request_id: str, future: concurrent.futures.Future) -> None:
        if future.exception() is not None or future.result() is None:
            with self._lock:
                self._sinks.pop(request_id, None)

    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None:
        # host shared memory: a CUDA tensor's IPC handle would need the parent to hold it until the child is done
        with contextlib.suppress(OSError):  # the child is gone: its requests fail through their sinks
            self._send(Embedding(mm_hash, _shareable(tensor), keep))

    def forget_embedding(self, mm_hash: str) -> None:
        with contextlib.suppress(OSError):
            self._send(Forget(mm_hash))

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Drop the request here at once and in the engine; the future holds whether the engine knew it."""
        with self._lock:
            self._sinks.pop(request_id, None)
        return self._call(lambda token: Abort(token, request_id))

    def encode(self, images: list) -> EncodedEmbeddings:
        """The vision tower in the child over `images` (blocking: call it from a thread)."""
        return EncodedEmbeddings(self._call(lambda token: Encode(token, images)).result())

    def _call(self, message: Callable[[int], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            if self._failure or self._stopping:
                future.set_exception(EngineGone(f"the engine process is gone ({self._failure or 'stopped'})"))
                return future
            self._replies[token] = future
        try:
            self._send(message(token))
        except OSError as exc:  # the pipe broke: the child died after the check above
            with self._lock:
                self._replies.pop(token, None)
            future.set_exception(EngineGone(f"the engine process is gone ({exc})"))
        return future

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._take(message)
            except Exception:  # a failing callback must not stop the reading: every other request waits on it
                log.exception("engine process: handling %s failed", type(message).__name__)
        self._lost()

    def _take(self, message: Any) -> None:
        if isinstance(message, Update):
            self._update(message)
        elif isinstance(message, Reply):
            with self._lock:
                future = self._replies.pop(message.token)
            if message.error is not None:
                future.set_exception(message.error)
            else:
                future.set_result(message.value)
        elif isinstance(message, Ready):
            self.snapshot = message.snapshot
            self._ready.set()
        elif isinstance(message, Failed):
            self._failure = message.message

    def _update(self, update: Update) -> None:
        with self._lock:  # only for streams still here: the server pops each when it sends the last output
            finished = {k: v for k, v in update.finished_at.items() if k in self._sinks}
        self.finished_at.update(finished)  # before the sinks: the server reads it on the last output
        self.snapshot = update.snapshot
        self.step_costs.coefficients = update.coefficients
        batch = []
        with self._lock:
            for request_id, output in update.outputs:
                sink = self._sinks.get(request_id)
                if output is None or output.request_finished:
                    self._sinks.pop(request_id, None)
                if sink is not None:
                    batch.append((sink, output))
        if batch:
            self.deliver(batch)
        if self.on_step is not None:  # after the sinks: a failing metrics callback costs metrics, not tokens
            for timing in update.timings:
                self.on_step(timing)

    def _lost(self) -> None:
        """The pipe closed: at stop, nothing to do; else the child died, and everything in flight fails."""
        with self._lock:
            self._failure = self._failure or f"exit code {self._process.exitcode}"
            sinks, self._sinks = self._sinks, {}
            replies, self._replies = self._replies, {}
        for future in replies.values():
            future.set_exception(EngineGone(f"the engine process is gone ({self._failure})"))
        if self._stopping or not self._ready.is_set():
            return
        log.critical("the engine process died (%s); failing %d running request(s)", self._failure, len(sinks))
        self.deliver([(sink, None) for sink in sinks.values()])
        self._on_lost()


def _exit_soon() -> None:
    """The worker cannot serve without its engine: exit (code 1) once the failed streams had a second to end."""
    threading.Timer(1.0, os._exit, args=(1,)).start()


def _shareable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host in memory that can be shared (one copy unless it already is)."""
    if tensor.device.type == "cpu" and tensor.is_shared():
        return tensor
    shared = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    shared.copy_(tensor)
    return shared


def _forked_child_main(parent_end: Connection, conn: Connection, config: WorkerConfig) -> None:
    """`child_main` in a forked child, which holds the parent's end of the pipe too: closed first, or the child
    would never see the pipe end when the parent dies."""
    parent_end.close()
    child_main(conn, config)
