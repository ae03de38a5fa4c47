"""API keys that name a tenant (`EPD_API_KEYS_FILE`), checked before any other work on a request.

The file has one key per line, `<tenant id> <sha256 hex of the key>`, separated by whitespace; `#` starts a
comment. Clients send `authorization: Bearer <key>` (gRPC metadata, or the HTTP header). Invariants: the
router never holds a key, only digests; the file is re-read when it changes (checked by `stat` at each
lookup, so a rotation takes effect on the next request, no restart); a file that cannot be read or parsed
keeps the previous table (logged) rather than locking everyone out or letting everyone in. Without a file,
authentication is off and every request belongs to DEFAULT_TENANT.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable

import grpc

from services.common.watched_files import WatchedFiles
from services.router.errors import RequestError

log = logging.getLogger(__name__)
DEFAULT_TENANT = "default"
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DIGEST = re.compile(r"^[0-9a-f]{64}$")


def key_digest(key: str) -> str:
    """What a keys file holds for `key`: its sha256, lowercase hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str) -> dict[str, str]:
    """Digest -> tenant id from a keys file's text; ValueError naming the line on anything malformed."""
    table: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not TENANT_ID.match(fields[0]) or not DIGEST.match(fields[1].lower()):
            raise ValueError(f"line {number}: expected '<tenant id> <sha256 hex of the key>'")
        table[fields[1].lower()] = fields[0]
    return table


def bearer(values: Iterable[str]) -> str | None:
    """The key from `authorization` values (`Bearer <key>`, scheme case-insensitive), or None."""
    for value in values:
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    return None


def unauthenticated(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAUTHENTICATED, message)


class ApiKeys:
    """The keys file, re-read when it changes; see the module invariants."""

    def __init__(self, path: str) -> None:
        self._file = WatchedFiles([path], lambda contents: parse_keys(contents[0].decode("utf-8")), "EPD_API_KEYS_FILE")
        table = self._file.value
        log.info("API keys: %d keys for %d tenants", len(table), len(set(table.values())))

    def tenant_for(self, key: str) -> str | None:
        return self._file.current().get(key_digest(key))

    def tenants(self) -> set[str]:
        return set(self._file.current().values())


class Authenticator:
    """Who is calling: the tenant named by the request's key, DEFAULT_TENANT when auth is off."""

    def __init__(self, keys: ApiKeys | None) -> None:
        self.keys = keys
        if keys is None:
            log.warning("EPD_API_KEYS_FILE unset: authentication is off; every request is tenant %r", DEFAULT_TENANT)

    @classmethod
    def from_file(cls, path: str) -> Authenticator:
        return cls(ApiKeys(path) if path else None)

    def tenant(self, authorization: Iterable[str]) -> str:
        """The caller's tenant; raises RequestError(UNAUTHENTICATED) for a missing or unknown key."""
        if self.keys is None:
            return DEFAULT_TENANT
        key = bearer(authorization)
        if key is None:
            raise unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        tenant = self.keys.tenant_for(key)
        if tenant is None:
            raise unauthenticated("invalid API key")
        return tenant

    def grpc_tenant(self, context: grpc.aio.ServicerContext) -> str:
        """`tenant` from a gRPC call's `authorization` metadata."""
        metadata = context.invocation_metadata() or ()
        return self.tenant(value for name, value in metadata if name == "authorization" and isinstance(value, str))
