"""TLS for every hop: gRPC server and channel credentials, and the HTTP listener's SSL context, from PEM files.

One set of names for every service (`EPD_TLS_CERT_FILE`, `EPD_TLS_KEY_FILE`, `EPD_TLS_CA_FILE`): with all
three, internal servers require a client certificate signed by the CA (mTLS) and clients verify servers
against it. Invariants: certificates are re-read when their files change (inode, size or mtime: a
cert-manager Secret swaps a symlink), checked on each server handshake and at most once a second on the
client side; a file that cannot be read or parsed keeps the previous pair in use (logged), so a half
written rotation never takes a listener down. Channels made before a rotation keep their connections;
`Dialer` makes new channels from the new files.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from services.common.grpc_server import channel_options
from services.common.rpc_context import ContextChannel
from services.common.watched_files import WatchedFiles

log = logging.getLogger(__name__)
CHECK_EVERY_S = 1.0


@dataclass(frozen=True)
class TlsFiles:
    """A certificate chain and its key (PEM), and the CA that verifies the peer ("" = verify no peer)."""

    cert_file: str
    key_file: str
    ca_file: str = ""

    def paths(self) -> list[str]:
        return [p for p in (self.cert_file, self.key_file, self.ca_file) if p]


def internal_tls(config: object) -> TlsFiles | None:
    """The cluster's own pair and CA from a service config (`tls_cert_file`, ...); None when TLS is off."""
    cert, key, ca = (getattr(config, f"tls_{name}_file", "") for name in ("cert", "key", "ca"))
    return TlsFiles(cert, key, ca) if cert and key and ca else None


def internal_server_credentials(config: object) -> grpc.ServerCredentials | None:
    """An internal server's credentials (mTLS: clients need a certificate of the cluster CA); None = plaintext."""
    files = internal_tls(config)
    return None if files is None else server_credentials(files, require_client_cert=True)


def internal_client(config: object) -> ClientTls | None:
    """What a service dials other services with (its own certificate, the cluster CA); None = plaintext."""
    files = internal_tls(config)
    return None if files is None else ClientTls(files, getattr(config, "tls_server_name", ""))


def client_from_env(env: Mapping[str, str]) -> ClientTls | None:
    """A client of the cluster from `EPD_TLS_*` variables (health checks, the launcher, the CLI); None when
    TLS is off."""
    files = TlsFiles(env.get("EPD_TLS_CERT_FILE", ""), env.get("EPD_TLS_KEY_FILE", ""), env.get("EPD_TLS_CA_FILE", ""))
    if not (files.cert_file and files.key_file and files.ca_file):
        return None
    return ClientTls(files, env.get("EPD_TLS_SERVER_NAME", ""))


def _watched(files: TlsFiles) -> WatchedFiles[list[bytes]]:
    """The files' bytes, re-read when any of them changes (cert-manager rotates them)."""
    return WatchedFiles(files.paths(), list, "TLS files")


def server_credentials(files: TlsFiles, require_client_cert: bool) -> grpc.ServerCredentials:
    """gRPC server credentials that re-read `files` on change; with `require_client_cert` (needs
    `files.ca_file`) a client must present a certificate signed by that CA."""
    if require_client_cert and not files.ca_file:
        raise ValueError("a client certificate can only be required with a CA file")
    watched = _watched(files)

    def config() -> grpc.ServerCertificateConfiguration:
        cert, key, *ca = watched.value
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca[0] if ca else None)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        if not watched.refresh():
            return None
        log.info("TLS: re-read %s", files.cert_file)
        return config()

    return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=require_client_cert)


class ClientTls:
    """Channel credentials from our pair (our client certificate) and the CA that verifies servers,
    rebuilt when the files change; `version` counts the rebuilds. `server_name`, when set, is the name
    every server's certificate must carry (instead of the dialed host: pod addresses are not in certs)."""

    def __init__(self, files: TlsFiles, server_name: str = "") -> None:
        if not files.ca_file:
            raise ValueError("a client needs the CA that signs the servers' certificates")
        self._files = files
        self._watched = _watched(files)
        self._checked = time.monotonic()
        self.server_name = server_name
        self.version = 0
        self.check_every_s = CHECK_EVERY_S

    def refresh(self) -> None:
        """Pick up changed files (at most one check per `check_every_s`)."""
        now = time.monotonic()
        if now - self._checked >= self.check_every_s:
            self._checked = now
            if self._watched.refresh():
                self.version += 1

    def credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._watched.value
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def options(self) -> list[tuple[str, object]]:
        extra = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*channel_options(), *extra]


def aio_channel(address: str, tls: ClientTls | None) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS with our client certificate when `tls`, else plaintext; each call
    carries the current request id and trace context (services/common/rpc_context.py)."""
    if tls is None:
        return ContextChannel(grpc.aio.insecure_channel(address, options=channel_options()))
    tls.refresh()
    return ContextChannel(grpc.aio.secure_channel(address, tls.credentials(), options=tls.options()))


def sync_channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    """A blocking channel to `address` (health checks, the CLI), like `aio_channel`."""
    if tls is None:
        return grpc.insecure_channel(address, options=channel_options())
    return grpc.secure_channel(address, tls.credentials(), options=tls.options())


class Dialer:
    """One asyncio channel per address, over mTLS when `tls` is set. Invariant: after the certificate
    files change, the next `channel(address)` is a new channel with the new files; the old one stays
    open (its calls finish) until `close()`."""

    def __init__(self, tls: ClientTls | None) -> None:
        self._tls = tls
        self._channels: dict[str, tuple[int, grpc.aio.Channel]] = {}
        self._retired: list[grpc.aio.Channel] = []

    def channel(self, address: str) -> grpc.aio.Channel:
        version = 0
        if self._tls is not None:
            self._tls.refresh()
            version = self._tls.version
        held = self._channels.get(address)
        if held is not None and held[0] == version:
            return held[1]
        if held is not None:
            self._retired.append(held[1])
        channel = aio_channel(address, self._tls)
        self._channels[address] = (version, channel)
        return channel

    async def close(self) -> None:
        for channel in [*(c for _, c in self._channels.values()), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()


def ssl_context(files: TlsFiles, require_client_cert: bool) -> ssl.SSLContext:
    """A server SSLContext for the HTTP listener that re-reads `files` on change (checked at each
    handshake); with `require_client_cert` a client must present a certificate signed by `files.ca_file`."""
    watched = _watched(files)

    def build() -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(files.cert_file, files.key_file)
        if files.ca_file:
            ctx.load_verify_locations(cafile=files.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
        ctx.sni_callback = swap
        return ctx

    current: list[ssl.SSLContext] = []

    def swap(sslobj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        if watched.refresh():
            try:
                current[0] = build()
                log.info("TLS: re-read %s", files.cert_file)
            except (OSError, ssl.SSLError) as exc:
                log.warning("TLS files not usable (%s); keeping the previous ones", exc)
        sslobj.context = current[0]

    current.append(build())
    return current[0]
