"""The engine host's interface: what the worker's server needs of wherever its engine runs (a thread, a process).

Two hosts implement `EngineHost`: `EngineLoop` (thread_host.py: the engine on a thread of the worker process)
and `EngineProcess` (process_host.py: the engine in a child process with a GIL of its own, `EPD_ENGINE_PROCESS`).
Invariants both keep: every call into the engine runs on the one thread that steps it; a request's sink is
registered when its admission succeeds and dropped at its last output, a failure or an abort, so no output
reaches a sink after that; one engine-loop iteration's outputs reach their sinks through one `deliver` call.
Tensor parallelism's rank processes are a further host behind the same interface.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from services.worker.engine.block_manager import KVState
    from services.worker.engine.request import EngineRequest, StepOutput
    from services.worker.engine.step_cost import StepTiming

Sink = Callable[[Any], None]  # takes a request's StepOutput, or None when the engine failed it
Delivery = Callable[[list[tuple[Sink, Any]]], None]


def call_sinks(batch: list[tuple[Sink, Any]]) -> None:
    """The default delivery: each sink called with its output, in order, on the calling thread."""
    for sink, output in batch:
        sink(output)


@dataclass(frozen=True)
class KVSnapshot:
    """The engine's KV state and the time (taken before reading it) it was read; routers compare their
    admissions and releases against `at`."""

    state: KVState
    at: float


class EngineLike(Protocol):
    """What a host calls on the engine (services/worker/engine/engine.py's `Engine`), all from one thread."""

    def bind_thread(self) -> None: ...
    def prepare(self, request: EngineRequest) -> list: ...
    def admit(self, request: EngineRequest, prepared: list | None = None) -> bool: ...
    def add_request(self, request: EngineRequest) -> None: ...
    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None: ...
    def forget_embedding(self, mm_hash: str) -> None: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[StepOutput]: ...
    def has_work(self) -> bool: ...
    def command_budget_s(self) -> float | None: ...
    def kv_state(self) -> KVState: ...


class EngineHost(Protocol):
    """Where the worker's engine runs, as the worker's server and start-up use it."""

    snapshot: KVSnapshot  # the latest KV state (one assignment: readers see a matching pair)
    finished_at: dict[str, float]  # request id -> when its blocks were freed; popped by the server
    deliver: Delivery  # how an iteration's outputs reach their sinks (the server: onto its event loop)
    on_step: Callable[[StepTiming], None] | None  # each timed step, for the metrics

    @property
    def kv_state(self) -> KVState: ...
    @property
    def step_costs(self) -> Any: ...  # the fitted step-cost coefficients (`coefficients`), for the metrics

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def add_admitted(self, request: EngineRequest, sink: Sink) -> concurrent.futures.Future: ...
    def provide_embedding(self, mm_hash: str, tensor: torch.Tensor, keep: bool = False) -> None: ...
    def forget_embedding(self, mm_hash: str) -> None: ...
    def abort(self, request_id: str) -> concurrent.futures.Future: ...
