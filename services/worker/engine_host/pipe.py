"""What a worker and its engine process (`process_host.py`, `child.py`) say over their pipe.

Down: `Admit`, `Embedding`, `Forget`, `Abort`, `Encode` (each call with a token its `Reply` carries back), `Stop`.
Up: `Ready` or `Failed` once at start, a `Reply` per call, an `Update` per engine-loop iteration that changed
something.
Tensors cross in shared memory (torch's reductions, registered by importing `torch.multiprocessing`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions: tensors cross in shared memory)

from services.worker.engine.step_cost import StepTiming
from services.worker.engine_host.host import KVSnapshot


@dataclasses.dataclass(frozen=True)
class Admit:
    token: int
    request: Any


@dataclasses.dataclass(frozen=True)
class Embedding:
    mm_hash: str
    tensor: torch.Tensor
    keep: bool = False


@dataclasses.dataclass(frozen=True)
class Forget:
    mm_hash: str


@dataclasses.dataclass(frozen=True)
class Abort:
    token: int
    request_id: str


@dataclasses.dataclass(frozen=True)
class Encode:
    token: int
    images: list


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class Ready:
    snapshot: KVSnapshot


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


@dataclasses.dataclass(frozen=True)
class Reply:
    token: int
    value: Any = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Update:
    """One engine-loop iteration's news: (request id, output or None for a failed request) in step order."""

    outputs: list[tuple[str, Any]]
    finished_at: dict[str, float]
    snapshot: KVSnapshot
    timings: list[StepTiming]
    coefficients: tuple[float, ...]
