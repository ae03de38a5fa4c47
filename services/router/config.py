"""Router settings (flags / EPD_* variables); see services/common/config.py for the rules."""

from __future__ import annotations

import dataclasses
import os

from services.common.config import ConfigError, ServiceConfig, env_name, require_positive
from services.common.tls import TlsFiles


@dataclasses.dataclass
class RouterConfig(ServiceConfig):
    port: int = 50051
    http_port: int = dataclasses.field(default=8000, metadata={"help": "OpenAI-compatible HTTP API port (0 = off)"})
    encoder_addrs: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "static encoders, used only while none is registered"}
    )
    max_images_per_prompt: int = dataclasses.field(default=8, metadata={"help": "images per request"})
    max_item_bytes: int = dataclasses.field(default=20 << 20, metadata={"help": "bytes per media item"})
    max_request_bytes: int = dataclasses.field(default=64 << 20, metadata={"help": "media bytes per request"})
    max_image_pixels: int = dataclasses.field(default=50_000_000, metadata={"help": "pixels per image"})
    max_videos_per_prompt: int = dataclasses.field(default=1, metadata={"help": "videos per request"})
    max_video_seconds: float = dataclasses.field(default=600.0, metadata={"help": "seconds per video (header)"})
    max_video_frames: int = dataclasses.field(default=36_000, metadata={"help": "frames a video may hold (header)"})
    max_video_frame_pixels: int = dataclasses.field(default=3840 * 2160, metadata={"help": "pixels per video frame"})
    default_max_tokens: int = dataclasses.field(default=256, metadata={"help": "when a request sets none"})
    max_tokens_cap: int = dataclasses.field(default=8192, metadata={"help": "largest max_tokens accepted"})
    max_projected_tokens: int = dataclasses.field(default=131072, metadata={"help": "prompt + n x max_tokens cap"})
    max_n: int = dataclasses.field(default=8, metadata={"help": "largest n (choices per request) accepted"})
    fetch_enabled: bool = dataclasses.field(default=True, metadata={"help": "allow https media URLs"})
    fetch_allowed_hosts: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "media URL host allowlist (empty = any public host)"}
    )
    fetch_timeout_s: float = dataclasses.field(default=15.0, metadata={"help": "total time per media URL"})
    fetch_max_redirects: int = dataclasses.field(default=0, metadata={"help": "redirects followed, re-checked"})
    fetch_allow_loopback_for_tests: bool = dataclasses.field(
        default=False, metadata={"help": "TESTS ONLY: let media URLs reach 127.0.0.1/::1 over http"}
    )
    admission_queue_size: int = dataclasses.field(default=64, metadata={"help": "requests waiting for KV"})
    admission_max_wait_s: float = dataclasses.field(default=2.0, metadata={"help": "longest wait: KV, encoders"})
    retry_after_ms: int = dataclasses.field(default=500, metadata={"help": "hint sent with refusals"})
    prefix_affinity_weight: float = dataclasses.field(
        default=1.0, metadata={"help": "placement: a cached prompt block's worth in reserved blocks (0 = load only)"}
    )
    request_timeout_s: float = dataclasses.field(default=120.0, metadata={"help": "per-request deadline"})
    encode_timeout_s: float = dataclasses.field(default=60.0, metadata={"help": "encoder call deadline"})
    migration_limit: int = dataclasses.field(
        default=3, metadata={"help": "times one request may move to another worker when its worker fails"}
    )
    public_tls_cert_file: str = dataclasses.field(
        default="", metadata={"help": "public listeners' certificate (default: EPD_TLS_CERT_FILE)"}
    )
    public_tls_key_file: str = dataclasses.field(default="", metadata={"help": "its private key"})
    public_tls_client_ca_file: str = dataclasses.field(
        default="", metadata={"help": "require public clients' certificates signed by this CA"}
    )
    api_keys_file: str = dataclasses.field(default="", metadata={"help": "'<tenant> <sha256 of key>' lines"})
    tenant_limits_file: str = dataclasses.field(default="", metadata={"help": "per-tenant limits"})
    structured_any_whitespace: bool = dataclasses.field(
        default=False, metadata={"help": "JSON constraints allow whitespace between tokens (default: compact)"}
    )
    structured_max_bytes: int = dataclasses.field(
        default=128 << 10, metadata={"help": "largest structured-output constraint (schema, regex, grammar), bytes"}
    )
    structured_max_depth: int = dataclasses.field(
        default=64, metadata={"help": "deepest nesting of a constraint (a schema's JSON containers, a regex's groups)"}
    )
    structured_compile_timeout_s: float = dataclasses.field(
        default=5.0, metadata={"help": "longest a constraint may take to compile before it is refused"}
    )
    structured_cache_entries: int = dataclasses.field(
        default=64, metadata={"help": "compiled constraints the router keeps (its check of a repeated one is free)"}
    )
    share_embeddings_across_tenants: bool = dataclasses.field(
        default=False, metadata={"help": "one embedding cache entry per image for every tenant"}
    )
    pd_min_prefill_tokens: int = dataclasses.field(
        default=0, metadata={"help": "uncached prompt tokens from which a prefill worker prefills (0: never)"}
    )
    pd_max_prefill_waiting: int = dataclasses.field(
        default=8, metadata={"help": "requests a prefill worker may have waiting and still be given another"}
    )

    def public_tls(self) -> TlsFiles | None:
        """The public listeners' TLS (gRPC and HTTP): their own pair or the cluster's; client certificates
        only with EPD_PUBLIC_TLS_CLIENT_CA_FILE. None: plaintext."""
        cert, key = self.public_tls_cert_file, self.public_tls_key_file
        if not cert and self.tls_cert_file and self.tls_key_file and self.tls_ca_file:
            cert, key = self.tls_cert_file, self.tls_key_file
        return TlsFiles(cert, key, self.public_tls_client_ca_file) if cert else None

    def validate(self) -> None:
        super().validate()
        for name in (
            "max_images_per_prompt",
            "max_item_bytes",
            "max_request_bytes",
            "max_image_pixels",
            "max_videos_per_prompt",
            "max_video_seconds",
            "max_video_frames",
            "max_video_frame_pixels",
            "default_max_tokens",
            "request_timeout_s",
            "encode_timeout_s",
            "max_tokens_cap",
            "max_projected_tokens",
            "max_n",
            "retry_after_ms",
            "structured_max_bytes",
            "structured_max_depth",
            "structured_compile_timeout_s",
        ):
            require_positive(name, getattr(self, name))
        if not 0 <= self.http_port < 65536:
            raise ConfigError(f"{env_name('http_port')}: {self.http_port} is not a port (0 turns HTTP off)")
        self._validate_security()
        if self.structured_cache_entries < 0:
            raise ConfigError(f"{env_name('structured_cache_entries')} must not be negative")
        if self.migration_limit < 0:
            raise ConfigError(f"{env_name('migration_limit')} must not be negative, got {self.migration_limit}")
        for name in ("pd_min_prefill_tokens", "pd_max_prefill_waiting"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{env_name(name)} must not be negative, got {getattr(self, name)}")
        if self.prefix_affinity_weight < 0:
            raise ConfigError(
                f"{env_name('prefix_affinity_weight')} must not be negative, got {self.prefix_affinity_weight}"
            )

    def _validate_security(self) -> None:
        if bool(self.public_tls_cert_file) != bool(self.public_tls_key_file):
            raise ConfigError("EPD_PUBLIC_TLS_CERT_FILE and EPD_PUBLIC_TLS_KEY_FILE go together")
        if self.public_tls_client_ca_file and self.public_tls() is None:
            raise ConfigError(
                "EPD_PUBLIC_TLS_CLIENT_CA_FILE needs a public certificate (EPD_PUBLIC_TLS_* or EPD_TLS_*)"
            )
        for name in (
            "public_tls_cert_file",
            "public_tls_key_file",
            "public_tls_client_ca_file",
            "api_keys_file",
            "tenant_limits_file",
        ):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{env_name(name)}: {path} is not a readable file")
