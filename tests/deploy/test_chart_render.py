"""The Helm chart: strict lint, rendering with Helm's engine, strict Kubernetes schema validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.support import (
    CHART,
    CI_VALUES,
    KUBE_VERSIONS,
    find,
    load_values,
    pod_specs,
    render,
    validate_manifest,
)

EXPECTED_SCENARIOS = {
    "default-values.yaml",
    "external-redis-values.yaml",
    "gpu-4enc-8wkr-values.yaml",
    "gpu-tp4-values.yaml",
    "cpu-dev-values.yaml",
    "pd-prefill-pool-values.yaml",
    "tls-auth-values.yaml",
}


@pytest.fixture(scope="module", params=CI_VALUES, ids=lambda p: p.name)
def scenario(request: pytest.FixtureRequest) -> tuple[Path, list[dict[str, Any]]]:
    path: Path = request.param
    return path, render(load_values(path))


def test_scenarios_present() -> None:
    assert {p.name for p in CI_VALUES} == EXPECTED_SCENARIOS


def test_chart_metadata() -> None:
    with helm.Chart.load(CHART) as chart:
        assert chart.metadata["apiVersion"] == "v2"
        assert chart.name == "epd"
        assert chart.schema is not None and chart.schema["additionalProperties"] is False
        names = {t["name"] for t in chart.templates}
    assert "templates/_helpers.tpl" in names and "templates/NOTES.txt" in names
    assert {
        "templates/statefulset-worker.yaml",
        "templates/deployment-router.yaml",
        "templates/deployment-encoder.yaml",
        "templates/hpa-router.yaml",
        "templates/hpa-encoder.yaml",
    } <= names


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_lint_strict(values_file: Path, kube_version: str) -> None:
    report = helm.lint(CHART, load_values(values_file), strict=True, kube_version=f"v{kube_version}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_every_manifest_is_valid_kubernetes(scenario: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = scenario
    assert len(docs) >= 10
    for doc in docs:
        for version in KUBE_VERSIONS:
            validate_manifest(doc, version)


def test_pods_are_non_root_with_read_only_root(scenario: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = scenario
    for component, spec in pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True, component
        assert spec["automountServiceAccountToken"] is False, component
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec.get("initContainers", []) + spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, (component, container["name"])
            assert ctx["allowPrivilegeEscalation"] is False, (component, container["name"])
            assert ctx["capabilities"]["drop"] == ["ALL"], (component, container["name"])
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], (component, container["name"])


def test_network_policies_cover_every_component(scenario: tuple[Path, list[dict[str, Any]]]) -> None:
    _, docs = scenario
    policies = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in find(docs, "NetworkPolicy")}
    workloads = {c for c, _ in pod_specs(docs)}
    assert workloads <= set(policies)
    assert policies["router"]["spec"]["policyTypes"] == ["Ingress", "Egress"]
    for component in ("encoder", "worker"):
        (rule, *_) = policies[component]["spec"]["ingress"]
        selector = rule["from"][0]["podSelector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": "epd", "app.kubernetes.io/instance": "demo"}
        assert "namespaceSelector" not in rule["from"][0]
