"""Service configuration from flags and `EPD_*` environment variables.

A dataclass field `foo_bar` is set, in order of precedence, from the flag `--foo-bar`, the
environment variable `EPD_FOO_BAR`, or its default. Compose files, Helm values and `epd up`
all use these same names (every setting is in docs/interfaces.md). Invalid values raise ConfigError with
the variable's name; nothing is validated with `assert`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

ENV_PREFIX = "EPD_"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the setting."""


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _field_kind(cls: type, field: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    kind = hints[field.name]
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return kind


TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})
"""How a boolean setting's value may be written (compared lowered, stripped)."""


def _parse(kind: Any, name: str, raw: str) -> Any:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in TRUE_WORDS:
                return True
            if lowered in FALSE_WORDS:
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if typing.get_origin(kind) in (list, tuple):
            items = [item.strip() for item in raw.split(",") if item.strip()]
            return tuple(items) if typing.get_origin(kind) is tuple else items
        return raw
    except ValueError as exc:
        raise ConfigError(f"{env_name(name)} / {flag_name(name)}: cannot read {raw!r} as {kind}") from exc


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the config dataclass `cls` (all default to None = unset)."""
    for field in dataclasses.fields(cls):
        help_text = field.metadata.get("help", "")
        parser.add_argument(
            flag_name(field.name), dest=field.name, default=None, help=f"{help_text} (env {env_name(field.name)})"
        )


def load(
    cls: type[T], args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> T:
    """Build `cls` from overrides, parsed flags, then environment, then defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = _field_kind(cls, field)
        if field.name in overrides:
            values[field.name] = overrides[field.name]
            continue
        raw = getattr(args, field.name, None) if args is not None else None
        if raw is None:
            raw = env.get(env_name(field.name))
        if raw is not None:
            values[field.name] = _parse(kind, field.name, str(raw))
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    return config


def to_env(config: Any) -> dict[str, str]:
    """The `EPD_*` variables that reproduce `config` in a child process."""
    out: dict[str, str] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        if isinstance(value, bool):
            out[env_name(field.name)] = "true" if value else "false"
        elif isinstance(value, Sequence) and not isinstance(value, str):
            out[env_name(field.name)] = ",".join(str(v) for v in value)
        else:
            out[env_name(field.name)] = str(value)
    return out


TRANSPORTS = ("grpc", "dist")
"""How a service pushes tensors to a worker (an encoder's embeddings, a prefill worker's KV): a gRPC client stream,
or torch.distributed with gRPC carrying control (services/common/transport_dist.py)."""


def require_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{env_name(name)} must be positive, got {value}")


def require_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{env_name(name)}: {value!r} is not one of {', '.join(choices)}")


@dataclasses.dataclass
class ServiceConfig:
    """Settings every service shares. Subclasses add their own and set `port` defaults."""

    model: str = dataclasses.field(default="", metadata={"help": "model folder"})
    redis_url: str = dataclasses.field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis URL"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "bind address"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port"})
    metrics_port: int = dataclasses.field(default=9400, metadata={"help": "Prometheus port, 0 = off"})
    health_port: int = dataclasses.field(
        default=0, metadata={"help": "plaintext gRPC health on 127.0.0.1 only (probes with TLS on), 0 = off"}
    )
    advertise_addr: str = dataclasses.field(default="", metadata={"help": "host:port others dial"})
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "logging level"})
    log_format: str = dataclasses.field(
        default="text", metadata={"help": "text, or json: one object per line with service, request and trace ids"}
    )
    device: str = dataclasses.field(default="cpu", metadata={"help": "cpu or cuda"})
    dtype: str = dataclasses.field(
        default="auto",
        metadata={"help": "float32, bfloat16, float16, or auto: the dtype the model folder's config declares"},
    )
    torch_threads: int = dataclasses.field(default=0, metadata={"help": "intra-op CPU threads, 0 = torch's default"})
    embedding_cache_bytes: int = dataclasses.field(default=512 << 20, metadata={"help": "in-process LRU"})
    embedding_cache_ttl_s: int = dataclasses.field(default=3600, metadata={"help": "Redis TTL"})
    drain_timeout_s: float = dataclasses.field(
        default=30.0, metadata={"help": "on SIGTERM: longest wait for in-flight work before ending it"}
    )
    launcher_pid: int = dataclasses.field(
        default=0, metadata={"help": "the process that started this one (`epd up`): when it is gone, drain and stop"}
    )
    tls_cert_file: str = dataclasses.field(default="", metadata={"help": "this service's certificate (PEM)"})
    tls_key_file: str = dataclasses.field(default="", metadata={"help": "its private key (PEM)"})
    tls_ca_file: str = dataclasses.field(default="", metadata={"help": "the cluster CA: mTLS on every hop"})
    tls_server_name: str = dataclasses.field(
        default="", metadata={"help": "name every internal server certificate carries (default: the dialed host)"}
    )
    cache_hmac_key_file: str = dataclasses.field(
        default="", metadata={"help": "cluster key that signs embedding cache entries"}
    )

    def validate(self) -> None:
        if not self.model:
            raise ConfigError(f"{env_name('model')} / {flag_name('model')}: a model folder is required")
        if self.log_format not in {"text", "json"}:
            raise ConfigError(f"{env_name('log_format')}: {self.log_format!r} is not text or json")
        from services.models.loading import DTYPES, read_folder_dtype

        if self.dtype == "auto":  # resolved here, once: every reader of the config sees the dtype computed in
            self.dtype = read_folder_dtype(self.model)
        if self.dtype not in DTYPES:
            raise ConfigError(f"{env_name('dtype')}: unknown dtype {self.dtype!r} ({', '.join(DTYPES)}, auto)")
        for name in ("port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{env_name(name)}: {getattr(self, name)} is not a port")
        if self.launcher_pid < 0:
            raise ConfigError(f"{env_name('launcher_pid')} must be a process id or 0, got {self.launcher_pid}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"{env_name('drain_timeout_s')} must not be negative, got {self.drain_timeout_s}")
        tls = {name: getattr(self, name) for name in ("tls_cert_file", "tls_key_file", "tls_ca_file")}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(env_name(name) for name, value in tls.items() if not value)
            raise ConfigError(
                f"TLS needs all three of EPD_TLS_CERT_FILE, EPD_TLS_KEY_FILE, EPD_TLS_CA_FILE; {missing} unset"
            )
        for name in (*tls, "cache_hmac_key_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{env_name(name)}: {path} is not a readable file")

    def computes_here(self) -> bool:
        """Whether this service's own process runs its torch compute (so `torch_threads` applies to it)."""
        return True

    @property
    def address(self) -> str:
        """The address other services dial to reach this one."""
        return self.advertise_addr or f"{self.host}:{self.port}"
