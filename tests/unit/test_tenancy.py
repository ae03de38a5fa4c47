"""API keys that name tenants (services/router/auth.py) and per-tenant limits and scoping (tenants.py)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from services.router import auth as auth_module
from services.router.admission import Rejection
from services.router.auth import DEFAULT_TENANT, ApiKeys, Authenticator, bearer, key_digest, parse_keys
from services.router.errors import RequestError
from services.router.tenants import LimitsFile, TenantGate, TenantLimit, item_key, parse_limits, prefix_salt


def write(path: Path, text: str) -> None:
    """Replace a file the way a Secret update does (a new inode)."""
    path.with_suffix(".new").write_text(text)
    os.replace(path.with_suffix(".new"), path)


def test_keys_file_names_tenants_by_digest_with_comments() -> None:
    text = f"# tenants\nalpha {key_digest('k-alpha')}  # first\n\nbeta\t{key_digest('k-beta').upper()}\n"
    assert parse_keys(text) == {key_digest("k-alpha"): "alpha", key_digest("k-beta"): "beta"}
    for bad in ("alpha", f"alpha {key_digest('x')} extra", "alpha nothex", f"al:pha {key_digest('x')}"):
        with pytest.raises(ValueError, match="line 1"):
            parse_keys(bad)


def test_bearer_reads_the_scheme_case_insensitively() -> None:
    assert bearer(["Bearer abc"]) == "abc"
    assert bearer(["bearer  abc "]) == "abc"
    assert bearer(["Basic abc"]) is None
    assert bearer(["Bearer "]) is None
    assert bearer([]) is None


def test_authenticator_refuses_missing_and_wrong_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write(keys, f"alpha {key_digest('k-alpha')}\n")
    auth = Authenticator.from_file(str(keys))
    assert auth.tenant(["Bearer k-alpha"]) == "alpha"
    for values in ([], ["Bearer wrong"], ["k-alpha"]):
        with pytest.raises(RequestError) as caught:
            auth.tenant(values)
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_without_a_keys_file_everyone_is_the_default_tenant() -> None:
    assert Authenticator.from_file("").tenant([]) == DEFAULT_TENANT


def test_rotating_the_keys_file_takes_effect_at_once_and_a_bad_file_keeps_the_old_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write(keys, f"alpha {key_digest('old')}\n")
    table = ApiKeys(str(keys))
    assert table.tenant_for("old") == "alpha"
    write(keys, f"alpha {key_digest('new')}\n")
    assert table.tenant_for("old") is None
    assert table.tenant_for("new") == "alpha"
    write(keys, "alpha not-a-digest\n")  # half-written or broken: keep what worked
    assert table.tenant_for("new") == "alpha"


def test_a_key_check_hashes_once_and_never_rereads_an_unchanged_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    write(keys, "".join(f"t{i} {key_digest(f'key-{i}')}\n" for i in range(1000)))
    auth = Authenticator.from_file(str(keys))
    parses: list[int] = []
    digests: list[str] = []
    real_parse, real_digest = auth_module.parse_keys, auth_module.key_digest

    def recording_parse(text: str) -> dict[str, str]:
        parses.append(len(text))
        return real_parse(text)

    def recording_digest(key: str) -> str:
        digests.append(key)
        return real_digest(key)

    monkeypatch.setattr(auth_module, "parse_keys", recording_parse)
    monkeypatch.setattr(auth_module, "key_digest", recording_digest)
    for i in range(200):
        with pytest.raises(RequestError):
            auth.tenant([f"Bearer wrong-{i}"])
    assert auth.tenant(["Bearer key-7"]) == "t7"
    # Each check is one digest and a table lookup: no per-key work, no re-read of the 1000-line file.
    assert digests == [f"wrong-{i}" for i in range(200)] + ["key-7"]
    assert parses == []
    write(keys, f"t0 {key_digest('key-0')}\n")
    assert auth.tenant(["Bearer key-0"]) == "t0" and len(parses) == 1  # a changed file is read again, once


def test_tenant_is_folded_into_salt_and_item_keys() -> None:
    assert prefix_salt("a", "") != prefix_salt("b", "")
    assert prefix_salt("a", "x") != prefix_salt("a", "")
    assert prefix_salt("a", "b:c") != prefix_salt("a:b", "c")
    h = "ab" * 32
    assert item_key(h, "a", shared=True) == h
    assert item_key(h, "a", shared=False) != item_key(h, "b", shared=False)
    assert len(item_key(h, "a", shared=False)) == 64


def test_limits_file_parses_and_applies_the_wildcard(tmp_path: Path) -> None:
    text = "# limits\n* concurrency=8\nsmall concurrency=1 tokens_per_minute=100\nfree\n"
    assert parse_limits(text)["small"] == TenantLimit(1, 100)
    path = tmp_path / "limits"
    write(path, text)
    limits = LimitsFile(str(path))
    assert limits.limit("small") == TenantLimit(1, 100)
    assert limits.limit("other") == TenantLimit(8, 0)
    assert limits.limit("free") == TenantLimit(0, 0)
    for bad in ("small burst=3", "small concurrency=-1", "sm:all concurrency=1"):
        with pytest.raises(ValueError, match="line 1"):
            parse_limits(bad)


def test_concurrency_limit_is_per_tenant(tmp_path: Path) -> None:
    path = tmp_path / "limits"
    write(path, "small concurrency=1\n")
    gate = TenantGate(LimitsFile(str(path)), retry_after_ms=250)
    gate.enter("small")
    with pytest.raises(Rejection) as caught:
        gate.enter("small")
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(caught.value.metadata)["retry-after-ms"] == "250"
    for _ in range(5):
        gate.enter("big")  # no limit of its own, no wildcard
    gate.leave("small")
    gate.enter("small")
    assert gate.in_flight("small") == 1 and gate.in_flight("big") == 5


def test_tokens_per_minute_is_a_bucket_with_the_wait_as_retry_hint(tmp_path: Path) -> None:
    path = tmp_path / "limits"
    write(path, "small tokens_per_minute=600\n")
    now = [100.0]
    gate = TenantGate(LimitsFile(str(path)), retry_after_ms=250, clock=lambda: now[0])
    gate.charge("small", 500)
    with pytest.raises(Rejection) as caught:
        gate.charge("small", 200)  # 100 left; 100 more take 10 s at 10 tokens/s
    assert dict(caught.value.metadata)["retry-after-ms"] == "10000"
    gate.charge("other", 10_000)  # another tenant is not limited
    now[0] += 10.0
    gate.charge("small", 200)
    with pytest.raises(Rejection, match="over tenant 'small'"):
        gate.charge("small", 601)  # never fits in a minute
