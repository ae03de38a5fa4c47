"""The config dataclasses' security settings: TLS files all or none, the public pair, errors naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load
from services.common.tls import TlsFiles, client_from_env, internal_tls
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from tests.certs import CertAuthority


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("config-pki")
    ca = CertAuthority.create(root, "cluster")
    internal, public = ca.issue(root, "internal"), ca.issue(root, "public")
    return {
        "EPD_TLS_CERT_FILE": str(internal.cert_file),
        "EPD_TLS_KEY_FILE": str(internal.key_file),
        "EPD_TLS_CA_FILE": str(ca.cert_file),
        "public_cert": str(public.cert_file),
        "public_key": str(public.key_file),
    }


def internal_env(files: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in files.items() if k.startswith("EPD_")}


def test_tls_is_all_three_files_or_none(files: dict[str, str], tmp_path: Path) -> None:
    worker = load(WorkerConfig, env={"EPD_MODEL": "m", **internal_env(files)})
    assert internal_tls(worker) == TlsFiles(
        files["EPD_TLS_CERT_FILE"], files["EPD_TLS_KEY_FILE"], files["EPD_TLS_CA_FILE"]
    )
    assert internal_tls(load(WorkerConfig, env={"EPD_MODEL": "m"})) is None
    partial = {"EPD_MODEL": "m", "EPD_TLS_CERT_FILE": files["EPD_TLS_CERT_FILE"]}
    with pytest.raises(ConfigError, match="EPD_TLS_KEY_FILE, EPD_TLS_CA_FILE unset"):
        load(WorkerConfig, env=partial)
    missing = {**internal_env(files), "EPD_MODEL": "m", "EPD_TLS_CA_FILE": str(tmp_path / "nope.pem")}
    with pytest.raises(ConfigError, match="EPD_TLS_CA_FILE: .* is not a readable file"):
        load(WorkerConfig, env=missing)


def test_public_listeners_serve_their_own_pair_or_the_clusters(files: dict[str, str]) -> None:
    cluster = load(RouterConfig, env={"EPD_MODEL": "m", **internal_env(files)})
    assert cluster.public_tls() == TlsFiles(files["EPD_TLS_CERT_FILE"], files["EPD_TLS_KEY_FILE"], "")
    own = {
        "EPD_MODEL": "m",
        "EPD_PUBLIC_TLS_CERT_FILE": files["public_cert"],
        "EPD_PUBLIC_TLS_KEY_FILE": files["public_key"],
        "EPD_PUBLIC_TLS_CLIENT_CA_FILE": files["EPD_TLS_CA_FILE"],
    }
    public_only = load(RouterConfig, env=own)
    assert public_only.public_tls() == TlsFiles(files["public_cert"], files["public_key"], files["EPD_TLS_CA_FILE"])
    assert internal_tls(public_only) is None
    assert load(RouterConfig, env={"EPD_MODEL": "m"}).public_tls() is None


def test_public_settings_that_cannot_work_are_refused(files: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="go together"):
        load(RouterConfig, env={"EPD_MODEL": "m", "EPD_PUBLIC_TLS_CERT_FILE": files["public_cert"]})
    with pytest.raises(ConfigError, match="needs a public certificate"):
        load(RouterConfig, env={"EPD_MODEL": "m", "EPD_PUBLIC_TLS_CLIENT_CA_FILE": files["EPD_TLS_CA_FILE"]})
    with pytest.raises(ConfigError, match="EPD_API_KEYS_FILE: /no/such is not a readable file"):
        load(RouterConfig, env={"EPD_MODEL": "m", "EPD_API_KEYS_FILE": "/no/such"})


def test_share_embeddings_is_off_by_default() -> None:
    assert load(RouterConfig, env={"EPD_MODEL": "m"}).share_embeddings_across_tenants is False
    env = {"EPD_MODEL": "m", "EPD_SHARE_EMBEDDINGS_ACROSS_TENANTS": "true"}
    assert load(RouterConfig, env=env).share_embeddings_across_tenants is True


def test_launcher_and_cli_clients_come_from_the_same_variables(files: dict[str, str]) -> None:
    client = client_from_env({**internal_env(files), "EPD_TLS_SERVER_NAME": "epd-internal"})
    assert client is not None and client.server_name == "epd-internal"
    assert ("grpc.ssl_target_name_override", "epd-internal") in client.options()
    assert client_from_env({"EPD_TLS_CERT_FILE": files["EPD_TLS_CERT_FILE"]}) is None
