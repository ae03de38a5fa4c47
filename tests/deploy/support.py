"""Helpers for the deployment tests: render the Helm chart, load the compose file, read the docs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "epd"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE = "demo"
NAMESPACE = "ml"
# The oldest Kubernetes the chart targets in CI and the newest kubernetes-validate ships.
KUBE_VERSIONS = ("1.33.0", kv_utils.latest_version())
# Custom resources kubernetes-validate has no schema for: (apiVersion, kind) -> schema file.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("cert-manager.io/v1", "Certificate"): "certificate-cert-manager-v1.json",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}


def load_values(path: Path) -> dict[str, Any]:
    """A values file as a dict (an empty file is {})."""
    return yaml.safe_load(path.read_text()) or {}


def render(values: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Render the chart with Helm's engine and return every manifest (NOTES.txt excluded)."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(
            dict(values) if values is not None else None, name=RELEASE, namespace=NAMESPACE, is_install=True
        )
    docs: list[dict[str, Any]] = []
    for name, text in sorted(files.items()):
        if not name.endswith(".yaml"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def validate_manifest(doc: Mapping[str, Any], version: str) -> None:
    """Validate one manifest strictly; custom resources against the schemas vendored here."""
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is None:
        kubernetes_validate.validate(dict(doc), version, strict=True)
        return
    import jsonschema

    schema = json.loads((SCHEMAS / crd).read_text())
    jsonschema.Draft202012Validator(schema).validate(dict(doc))


def find(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> list[dict[str, Any]]:
    """Manifests of `kind`, optionally only those labelled with `component`."""
    return [
        d
        for d in docs
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def one(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    """Exactly one manifest of `kind` for `component`."""
    found = find(docs, kind, component)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} for {component}, found {len(found)}")
    return found[0]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(component, pod spec) of every Deployment and StatefulSet."""
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            yield doc["metadata"]["labels"]["app.kubernetes.io/component"], doc["spec"]["template"]["spec"]


def env_of(container: Mapping[str, Any]) -> dict[str, str]:
    """A container's plain `value` environment variables."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def interface_env_names() -> set[str]:
    """The EPD_* names agreed in docs/interfaces.md (its configuration table)."""
    text = (REPO / "docs" / "interfaces.md").read_text()
    return set(re.findall(r"^\|\s*(EPD_[A-Z0-9_]+)\s*\|", text, flags=re.MULTILINE))


def values_leaf_paths(values: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of a values tree, stopping at Kubernetes objects passed through as-is."""
    opaque = ("resources", "podSecurityContext", "securityContext", "podSelector")
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value and not path.endswith(opaque):
            yield from values_leaf_paths(value, path)
        else:
            yield path


_VAR = re.compile(
    r"\$\$|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose-style variable interpolation (`$$`, `$VAR`, `${VAR}`, `${VAR:-d}`, `${VAR-d}`)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        current = env.get(name)
        if op == ":-" and not current:
            return arg
        if op == "-" and current is None:
            return arg
        if op in (":?", "?") and not current:
            raise ValueError(f"compose variable {name} is required: {arg}")
        return current or ""

    return _VAR.sub(substitute, value)


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as Compose reads it: YAML merge keys resolved, then variables interpolated."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(raw, env or {})
