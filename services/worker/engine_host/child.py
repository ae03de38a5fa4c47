"""The engine process's side (`EngineProcess` starts it): load the model, run an `EngineLoop`, serve the pipe.

Commands from the pipe go into the engine loop (a reader on the main thread, which also prepares each admission:
its sequences, positions and checks, while the engine thread steps); after each engine-loop iteration the engine
thread sends what changed (`Update`); co-located encodes run on a thread of their own.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

from services.worker.config import WorkerConfig
from services.worker.engine.step_cost import StepTiming
from services.worker.engine_host.fork import detach_from_parent
from services.worker.engine_host.pipe import Abort, Admit, Embedding, Encode, Failed, Forget, Ready, Reply, Stop, Update
from services.worker.engine_host.thread_host import EngineLoop

log = logging.getLogger(__name__)

IDLE_SNAPSHOT_S = 0.05
"""The child sends its KV snapshot at least this often while anything is running, changed or not."""


class EngineChild:
    """The child's side: commands from the pipe into an `EngineLoop`; its news back once per iteration."""

    def __init__(self, conn: Connection, engine: Any, runner: Any, nice: int) -> None:
        self._conn = conn
        self._engine = engine
        self._runner = runner
        self._send_lock = threading.Lock()
        self._outputs: list[tuple[str, Any]] = []  # engine thread only
        self._timings: list[StepTiming] = []  # engine thread only
        self._sent: tuple[Any, float] = (None, 0.0)  # the last snapshot state sent, and when
        engine.on_step = self._timed
        self.loop = EngineLoop(engine, nice=nice, after_iteration=self._publish)
        self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-encode")

    def run(self) -> None:
        self.loop.start()
        self._send(Ready(self.loop.snapshot))
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Stop):
                break
            self._handle(message)
        self.loop.stop()
        self._encoder.shutdown(wait=False, cancel_futures=True)

    def _handle(self, message: Any) -> None:
        if isinstance(message, Admit):
            try:  # here, beside the engine thread's step: that thread only checks its state, reserves and queues
                prepared = self._engine.prepare(message.request)
            except Exception as exc:  # a malformed request, or one that never fits: the engine's own errors
                self._send(Reply(message.token, None, exc))
                return
            request_id = message.request.request_id
            sink = functools.partial(self._collect, request_id)
            admitted = self.loop.add_admitted(message.request, sink, prepared)
            admitted.add_done_callback(functools.partial(self._reply, message))
        elif isinstance(message, Embedding):
            self.loop.provide_embedding(message.mm_hash, message.tensor, message.keep)
        elif isinstance(message, Forget):
            self.loop.forget_embedding(message.mm_hash)
        elif isinstance(message, Abort):
            self.loop.abort(message.request_id).add_done_callback(functools.partial(self._reply, message))
        elif isinstance(message, Encode):
            encoded = self._encoder.submit(lambda images: self._runner.encode(images).embeddings, message.images)
            encoded.add_done_callback(functools.partial(self._reply, message))

    def _timed(self, timing: StepTiming) -> None:
        self._timings.append(timing)

    def _collect(self, request_id: str, output: Any) -> None:
        self._outputs.append((request_id, output))

    def _reply(self, message: Any, future: concurrent.futures.Future) -> None:
        error = future.exception()
        self._send(Reply(message.token, None if error is not None else future.result(), error))

    def _publish(self) -> None:
        """After each engine-loop iteration (engine thread): send what changed, or the snapshot now and then."""
        snapshot = self.loop.snapshot
        last_state, last_at = self._sent
        quiet = not self._outputs and not self._timings and snapshot.state == last_state
        if quiet and (snapshot.at - last_at < IDLE_SNAPSHOT_S or not self._engine.has_work()):
            return
        outputs, self._outputs = self._outputs, []
        timings, self._timings = self._timings, []
        finished, self.loop.finished_at = self.loop.finished_at, {}
        self._sent = (snapshot.state, snapshot.at)
        self._send(Update(outputs, finished, snapshot, timings, self._engine.step_costs.coefficients))

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)


def child_main(conn: Connection, config: WorkerConfig) -> None:
    """The child process: load the model and engine from ``config``, then serve the pipe until told to stop."""
    from services.common.collector import FullCollections
    from services.common.model_info import load_model_info
    from services.common.service_main import dtype_of, setup_logging
    from services.models.vision_runner import VisionRunner
    from services.worker.engine.engine import Engine

    detach_from_parent()  # Ctrl-C reaches the whole group: the worker drains, then stops us
    setup_logging(config.log_level, "worker-engine", config.log_format)
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    try:
        info = load_model_info(config.model)
        model = info.adapter.load_model(device=config.device, dtype=dtype_of(config.dtype))
        engine = Engine(info.adapter, model, config.engine_config())
        child = EngineChild(conn, engine, VisionRunner(info.adapter, model), config.compute_nice)
    except Exception as exc:  # reported to the parent, which names it in its own start-up error
        log.exception("engine process start-up failed")
        conn.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    FullCollections().start()  # the model and libraries frozen; full collections only when quiet
    child.run()
