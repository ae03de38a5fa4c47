"""docs/deploy.md, the chart README and README.md's Deploy section, read as a new user would:
what they name exists."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from services.cli import _parser as epd_parser
from tests.deploy.support import (
    CHART,
    KUBE_VERSIONS,
    REPO,
    find,
    load_compose,
    render,
    validate_manifest,
    values_leaf_paths,
)

COMPONENTS = ("router", "encoder", "worker", "prefill")


def readme_deploy() -> str:
    """README.md's "## Deploy" section, which must be its last."""
    text = (REPO / "README.md").read_text()
    assert "\n## Deploy\n" in text, "README.md has no Deploy section"
    section = text.split("\n## Deploy\n", 1)[1]
    assert "\n## " not in section, "the Deploy section must be README.md's last"
    return section


DOCS: dict[str, Callable[[], str]] = {
    "docs/deploy.md": (REPO / "docs" / "deploy.md").read_text,
    "charts/epd/README.md": (CHART / "README.md").read_text,
    "README.md#deploy": readme_deploy,
}
USER_GUIDES = ("docs/deploy.md", "README.md#deploy")


def shell_lines(text: str) -> Iterator[str]:
    """Commands in ```bash blocks, continuation lines joined, comments dropped."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                yield from (part.strip() for part in line.split("&&"))


def value_exists(values: dict[str, Any], dotted: str) -> bool:
    node: Any = values
    for key in dotted.split("."):
        if isinstance(node, dict) and not node:
            return True  # inside a free-form map such as `env` or `nodeSelector`
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


@pytest.mark.parametrize("doc", sorted(DOCS), ids=str)
def test_helm_values_named_in_docs_exist(doc: str) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = DOCS[doc]()
    keys = re.findall(r"--set(?:-string|-json)?\s+([A-Za-z0-9_.]+)=", text)
    keys += re.findall(r"`((?:image|model|metrics|redis|worker|encoder|router|networkPolicy)\.[A-Za-z0-9_.]+)`", text)
    assert keys
    missing = [k for k in keys if not value_exists(values, k)]
    assert missing == [], missing


@pytest.mark.parametrize("doc", sorted(DOCS), ids=str)
def test_files_named_in_docs_exist(doc: str) -> None:
    text = DOCS[doc]()
    paths = set(re.findall(r"(?<![\w/.])((?:charts|deploy|docs|tests)/[\w./-]+\.(?:ya?ml|json|md|example))", text))
    paths |= {f"charts/epd/ci/{name}" for name in re.findall(r"(?<![\w/])ci/([\w-]+\.yaml)", text)}
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == [], missing


def test_epd_commands_in_docs_parse() -> None:
    parser = epd_parser()
    commands = [
        line for text in (read() for read in DOCS.values()) for line in shell_lines(text) if line.startswith("epd ")
    ]
    assert any(c.startswith("epd up --ray") for c in commands)
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])


@pytest.mark.parametrize("doc", USER_GUIDES)
def test_guides_give_the_helm_compose_and_ray_commands(doc: str) -> None:
    lines = list(shell_lines(DOCS[doc]()))
    assert any(line.startswith("helm install epd charts/epd") for line in lines), doc
    assert any(line.startswith("docker compose up") for line in lines), doc
    assert any(line.startswith("epd up --ray") for line in lines), doc
    assert "EPD_WORKER_ADDRS" not in DOCS[doc]()


@pytest.mark.parametrize("doc", USER_GUIDES)
def test_compose_services_named_in_docs_exist(doc: str) -> None:
    services = set(load_compose()["services"])
    for line in shell_lines(DOCS[doc]()):
        words = shlex.split(line.split("docker compose", 1)[1]) if "docker compose" in line else []
        if "up" in words:
            named = [w for w in words[words.index("up") + 1 :] if not w.startswith("-")]
            assert set(named) <= services, named


def test_chart_readme_documents_every_value() -> None:
    readme = DOCS["charts/epd/README.md"]()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = []
    for path in values_leaf_paths(values):
        generic = re.sub(rf"^({'|'.join(COMPONENTS)})\.", "<c>.", path)
        if f"`{path}`" not in readme and f"`{generic}`" not in readme:
            undocumented.append(path)
    assert undocumented == [], undocumented


def helm_install_values(line: str) -> dict[str, Any]:
    """The values a `helm install` line passes (`-f FILE`, `--set`, `--set-string`, `--set-json` k=v), as Helm
    types them (`--set` makes integers and booleans of text, never floats)."""
    words = shlex.split(line)
    values: dict[str, Any] = {}
    for flag, arg in zip(words, words[1:], strict=False):
        if flag in ("-f", "--values"):
            values = merge(values, yaml.safe_load((REPO / arg).read_text()) or {})
        elif flag in ("--set", "--set-string", "--set-json"):
            key, raw = arg.split("=", 1)
            typed: Any = json.loads(raw) if flag == "--set-json" else raw
            if flag == "--set" and raw in ("true", "false"):
                typed = raw == "true"
            elif flag == "--set" and re.fullmatch(r"-?\d+", raw):
                typed = int(raw)
            node = values
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = typed
    return values


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_helm_install_commands_in_docs_render_valid_manifests(doc: str) -> None:
    installs = [line for line in shell_lines(DOCS[doc]()) if line.startswith("helm install epd charts/epd")]
    assert installs
    for line in installs:
        docs = render(helm_install_values(line))
        assert find(docs, "StatefulSet", "worker"), line
        for manifest in docs:
            validate_manifest(manifest, KUBE_VERSIONS[0])
