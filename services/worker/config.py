"""Worker settings (flags / EPD_* variables); see services/common/config.py for the rules.

The engine's settings are `EngineConfig`'s own fields, inherited here: declared, defaulted and validated
once, in services/worker/engine/config.py; this class adds what only the worker service has.
"""

from __future__ import annotations

import dataclasses

from services.common.config import (
    FALSE_WORDS,
    TRANSPORTS,
    TRUE_WORDS,
    ConfigError,
    ServiceConfig,
    env_name,
    require_choice,
    require_positive,
)
from services.worker.engine.config import EngineConfig

ENGINE_PROCESS_MODES = ("auto", "on", "off")


@dataclasses.dataclass
class WorkerConfig(ServiceConfig, EngineConfig):
    port: int = 50071
    heartbeat_interval_s: float = dataclasses.field(default=0.2, metadata={"help": "registry heartbeat"})
    compute_nice: int = dataclasses.field(
        default=0, metadata={"help": "nice increment for the engine thread and its torch threads (0: off)"}
    )
    max_image_pixels: int = dataclasses.field(default=50_000_000, metadata={"help": "pixels per co-located image"})
    embedding_timeout_s: float = dataclasses.field(default=60.0, metadata={"help": "wait per embedding"})
    kv_transfer_timeout_s: float = dataclasses.field(
        default=60.0, metadata={"help": "longest a remote prefill's KV push to its decode worker may take"}
    )
    kv_transport: str = dataclasses.field(
        default="grpc",
        metadata={"help": "a prefill worker's KV push: grpc, or dist (torch.distributed gloo, gRPC for control)"},
    )
    engine_process: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "run the engine in a child process with a GIL of its own (docs/engine.md): on, off, or auto "
            "(on for a CPU worker of role both without tensor parallelism)"
        },
    )

    def __post_init__(self) -> None:
        """Checked by `validate` (which names the variables), not at construction as a bare EngineConfig is."""

    def engine_in_child(self) -> bool:
        """Whether the engine runs in a child process: ``on``, or ``auto`` on the CPU for a worker of role ``both``
        without tensor parallelism (a GPU engine, the prefill/decode roles and TP ranks stay on the thread host)."""
        if self.engine_process == "auto":
            return self.device.startswith("cpu") and self.worker_role == "both" and self.tensor_parallel_size == 1
        return self.engine_process == "on"

    def computes_here(self) -> bool:
        """False with the engine in a child process: the child sets its own threads, and this process forks it
        before any thread of torch's starts (services/worker/engine_host/fork.py)."""
        return not self.engine_in_child()

    def engine_config(self) -> EngineConfig:
        """The engine's settings among the worker's: the fields `EngineConfig` declares."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})

    def validate(self) -> None:
        super().validate()
        try:
            self.check(env_name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("embedding_timeout_s", "heartbeat_interval_s", "kv_transfer_timeout_s"):
            require_positive(name, getattr(self, name))
        require_choice("kv_transport", self.kv_transport, TRANSPORTS)
        word = str(self.engine_process).strip().lower()  # a boolean's spellings name on and off
        self.engine_process = "on" if word in TRUE_WORDS else "off" if word in FALSE_WORDS else word
        require_choice("engine_process", self.engine_process, ENGINE_PROCESS_MODES)
        if self.engine_process == "on" and self.worker_role != "both":
            raise ConfigError(
                f"{env_name('worker_role')}={self.worker_role} with {env_name('engine_process')}=on: KV transfer "
                "runs on the thread host only"
            )
        if self.engine_process == "on" and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"{env_name('engine_process')}=on cannot spawn tensor-parallel ranks "
                f"({env_name('tensor_parallel_size')}={self.tensor_parallel_size}): its child is daemonic; use one"
            )
