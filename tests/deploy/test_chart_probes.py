"""Every startup, readiness and liveness probe of every epd service asks the service's gRPC health, in every TLS
scenario the chart renders. With TLS off, the kubelet's gRPC probe on the service port; with TLS on, the health
check against the pod's loopback health listener (`EPD_HEALTH_PORT`), which the service port's own health
servicer answers (tests/integration/test_health_listener.py); never a TCP or HTTP check."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.deploy.support import (
    CHART,
    CI_VALUES,
    KUBE_VERSIONS,
    WORKLOAD_KINDS,
    load_values,
    pod_specs,
    render,
    validate_manifest,
)

TLS_AUTH = load_values(CHART / "ci" / "tls-auth-values.yaml")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
ACTIONS = ("grpc", "exec", "tcpSocket", "httpGet")


def _tls(existing: str = "", public: str = "", client_ca: str = "") -> dict[str, Any]:
    """The security scenario with the cluster pair from cert-manager (or `existing`), and the router's public
    pair (`public`) and public client CA (`client_ca`) from Secrets when named."""
    values = copy.deepcopy(TLS_AUTH)
    tls = values["tls"]
    tls["certManager"]["enabled"] = not existing
    tls["existingSecret"] = existing
    tls["public"] = {"existingSecret": public, "clientCaSecret": client_ca}
    return values


SCENARIOS: dict[str, dict[str, Any]] = {
    **{path.name: load_values(path) for path in CI_VALUES},
    "cluster pair from cert-manager on every port": _tls(),
    "cluster pair from an existing Secret on every port": _tls(existing="epd-cluster-tls"),
    "public pair from an existing Secret": _tls(public="epd-public-tls"),
    "public client CA with the cluster pair": _tls(client_ca="epd-public-client-ca"),
    "public pair and public client CA": _tls(existing="epd-cluster-tls", public="epd-public-tls", client_ca="epd-ca"),
}


def _health_check(container: dict[str, Any]) -> dict[str, Any]:
    """The one probe action every probe of `container` must have: what asks its gRPC health."""
    env = {e["name"]: e.get("value") for e in container["env"]}
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    if "EPD_TLS_CA_FILE" not in env:
        assert "EPD_HEALTH_PORT" not in env, "without TLS the kubelet asks the service port itself"
        return {"grpc": {"port": grpc_port}}
    health_port = int(env["EPD_HEALTH_PORT"])
    assert health_port not in {p["containerPort"] for p in container["ports"]}, "the health port is loopback only"
    return {"exec": {"command": ["python", "-m", "services.launch.health", "--plaintext", f"127.0.0.1:{health_port}"]}}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_probe_asks_grpc_health(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    components = set()
    for component, spec in pod_specs(docs):
        if component == "redis":
            continue
        (container,) = spec["containers"]
        expected = _health_check(container)
        for probe in PROBES:
            action = {k: v for k, v in container[probe].items() if k in ACTIONS}
            assert action == expected, (scenario, component, probe)
        components.add(component)
    assert components - {"prefill"} == {"router", "encoder", "worker"}, scenario  # a prefill pool where enabled
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            validate_manifest(doc, KUBE_VERSIONS[-1])


def test_the_scenarios_cover_every_tls_mode() -> None:
    """TLS off, the cluster pair from cert-manager or a Secret, and a router public pair and client CA of its own:
    the two a pod's own certificate cannot probe (the old TCP check's case, and an mTLS probe's refusal)."""
    routers = []
    for values in SCENARIOS.values():
        (router,) = [spec["containers"][0] for c, spec in pod_specs(render(values)) if c == "router"]
        routers.append({e["name"] for e in router["env"]} & {"EPD_TLS_CA_FILE", "EPD_PUBLIC_TLS_CERT_FILE",
                                                             "EPD_PUBLIC_TLS_CLIENT_CA_FILE"})  # fmt: skip
    assert set() in routers and {"EPD_TLS_CA_FILE"} in routers
    assert {"EPD_TLS_CA_FILE", "EPD_PUBLIC_TLS_CERT_FILE"} in routers
    assert {"EPD_TLS_CA_FILE", "EPD_PUBLIC_TLS_CLIENT_CA_FILE"} in routers
