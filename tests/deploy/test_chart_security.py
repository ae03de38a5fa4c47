"""The chart's security and tenancy scenario: Secrets only, no secret value rendered.

TLS from cert-manager or a Secret, keys, limits and the cache key from Secrets, a password-protected Redis,
narrowed NetworkPolicies, and no secret value in any rendered manifest. Strict validity of every manifest is
checked for `ci/tls-auth-values.yaml` with the other scenarios (test_chart_render.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.support import (
    CHART,
    CI_VALUES,
    KUBE_VERSIONS,
    find,
    load_values,
    one,
    pod_specs,
    render,
    validate_manifest,
)

TLS_AUTH = CHART / "ci" / "tls-auth-values.yaml"
CANARY = "s3cr3t-canary-value"  # what a careless chart would copy from values into a manifest
PASSWORD_IN_URL = re.compile(r"rediss?://[^/@\s]*:(?!\$\()[^/@\s]+@")


def containers(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    for found, spec in pod_specs(docs):
        if found == component:
            return spec["containers"][0]
    raise AssertionError(f"no {component} pod")


def env_entries(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(load_values(TLS_AUTH))


def test_every_epd_pod_gets_the_cluster_pair_from_the_certificate_secret(docs: list[dict[str, Any]]) -> None:
    (certificate,) = find(docs, "Certificate")
    spec = certificate["spec"]
    assert spec["secretName"] == "demo-epd-tls" and spec["issuerRef"]["name"] == "epd-cluster-ca"
    assert {"server auth", "client auth"} <= set(spec["usages"]) and "epd-internal" in spec["dnsNames"]
    for component in ("router", "encoder", "worker"):
        container = containers(docs, component)
        env = env_entries(container)
        assert env["EPD_TLS_CERT_FILE"]["value"] == "/etc/epd/tls/tls.crt", component
        assert env["EPD_TLS_CA_FILE"]["value"] == "/etc/epd/tls/ca.crt", component
        assert env["EPD_TLS_SERVER_NAME"]["value"] == "epd-internal", component
        assert env["EPD_CACHE_HMAC_KEY_FILE"]["value"] == "/etc/epd/cache-hmac/key", component
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/etc/epd/tls"]["readOnly"] is True
        pod = next(spec for c, spec in pod_specs(docs) if c == component)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "demo-epd-tls"
        if component != "router":  # encoders and workers never see the router's keys or limits
            assert "EPD_API_KEYS_FILE" not in env and "api-keys" not in volumes and "tenant-limits" not in volumes
            assert container["readinessProbe"]["exec"]["command"][:3] == ["python", "-m", "services.launch.health"]


def test_router_reads_keys_limits_and_its_public_pair_from_secrets(docs: list[dict[str, Any]]) -> None:
    router = containers(docs, "router")
    env = env_entries(router)
    assert env["EPD_API_KEYS_FILE"]["value"] == "/etc/epd/api-keys/api-keys"
    assert env["EPD_TENANT_LIMITS_FILE"]["value"] == "/etc/epd/tenant-limits/tenant-limits"
    assert env["EPD_PUBLIC_TLS_CERT_FILE"]["value"] == "/etc/epd/public-tls/tls.crt"
    assert env["EPD_SHARE_EMBEDDINGS_ACROSS_TENANTS"]["value"] == "false"
    pod = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert secrets["api-keys"]["secretName"] == "epd-api-keys"
    assert secrets["api-keys"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    assert secrets["tenant-limits"]["secretName"] == "epd-tenant-limits"
    assert secrets["public-tls"]["secretName"] == "epd-public-tls"


def test_redis_password_travels_only_by_secret_reference(docs: list[dict[str, Any]]) -> None:
    for component in ("router", "encoder", "worker"):
        entries = list(containers(docs, component)["env"])
        names = [e["name"] for e in entries]
        password = entries[names.index("REDIS_PASSWORD")]
        assert password["valueFrom"]["secretKeyRef"] == {"name": "epd-redis", "key": "redis-password"}
        url = entries[names.index("EPD_REDIS_URL")]
        assert url["value"] == "redis://:$(REDIS_PASSWORD)@demo-epd-redis:6379/0"
        assert names.index("REDIS_PASSWORD") < names.index("EPD_REDIS_URL"), "Kubernetes expands only earlier vars"
    redis = containers(docs, "redis")
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    env = env_entries(redis)
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]["name"] == "epd-redis"


def test_network_policies_narrow_router_callers_and_metric_scrapers(docs: list[dict[str, Any]]) -> None:
    router = one(docs, "NetworkPolicy", "router")["spec"]["ingress"]
    callers, scrapers = router[0]["from"], router[1]["from"]
    assert callers == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert scrapers == monitoring
    for component in ("encoder", "worker"):
        rules = one(docs, "NetworkPolicy", component)["spec"]["ingress"]
        assert rules[-1]["from"] == monitoring


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_no_rendered_manifest_holds_a_secret_value(values_file: Path) -> None:
    docs = render(load_values(values_file))
    assert not find(docs, "Secret"), "the chart must not create Secrets (it takes existing ones)"
    text = yaml.safe_dump_all(docs)
    assert not PASSWORD_IN_URL.search(text), PASSWORD_IN_URL.search(text)
    assert "BEGIN" not in text and "PRIVATE KEY" not in text
    for component, spec in pod_specs(docs):
        for container in spec.get("initContainers", []) + spec["containers"]:
            for entry in container.get("env", []):
                if re.search(r"PASSWORD|AUTH$|SECRET|_KEY$", entry["name"]):
                    assert "valueFrom" in entry, (component, entry)


def test_secrets_in_values_are_refused_or_never_rendered() -> None:
    values = load_values(TLS_AUTH)
    values["redis"]["external"] = {"url": f"redis://:{CANARY}@redis.example:6379/0"}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match="must not hold a password"):
        chart.render(values, name="demo", namespace="ml")
    values = load_values(TLS_AUTH)
    values["redis"] = {"enabled": False, "external": {"existingSecret": "epd-redis-url"}}
    docs = render(values)
    assert not find(docs, "Deployment", "redis")
    for component in ("router", "encoder", "worker"):
        env = env_entries(containers(docs, component))
        assert env["EPD_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "epd-redis-url", "key": "redis-url"}
        assert "value" not in env["EPD_REDIS_URL"]
    for doc in docs:
        for version in KUBE_VERSIONS:
            validate_manifest(doc, version)


def test_tls_from_an_existing_secret_needs_no_cert_manager() -> None:
    values = load_values(TLS_AUTH)
    values["tls"]["certManager"]["enabled"] = False
    values["tls"]["existingSecret"] = "epd-cluster-tls"
    values["tls"]["public"]["existingSecret"] = ""
    docs = render(values)
    assert not find(docs, "Certificate")
    router = one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in router["volumes"]}["tls"]["secret"]["secretName"] == "epd-cluster-tls"
    probe = router["containers"][0]["readinessProbe"]
    assert probe["exec"]["command"] == [
        "python",
        "-m",
        "services.launch.health",
        "--plaintext",
        "127.0.0.1:50090",
    ]  # the loopback health listener, as in every TLS mode (test_chart_probes.py)
    values["tls"]["existingSecret"] = ""
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match="tls.existingSecret"):
        chart.render(values, name="demo", namespace="ml")
