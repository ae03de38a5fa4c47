"""docs/deploy.md and the chart README, read as a new user would: what they name exists."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from services.cli import _parser as epd_parser
from tests.deploy.support import CHART, REPO, load_compose, values_leaf_paths

DOCS = {"docs/deploy.md": REPO / "docs" / "deploy.md", "charts/epd/README.md": CHART / "README.md"}
COMPONENTS = ("router", "encoder", "worker")


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
    text = DOCS[doc].read_text()
    keys = re.findall(r"--set(?:-string)?\s+([A-Za-z0-9_.]+)=", text)
    keys += re.findall(r"`((?:image|model|metrics|redis|worker|encoder|router|networkPolicy)\.[A-Za-z0-9_.]+)`",
                       text)
    assert keys
    missing = [k for k in keys if not value_exists(values, k)]
    assert missing == [], missing


@pytest.mark.parametrize("doc", sorted(DOCS), ids=str)
def test_files_named_in_docs_exist(doc: str) -> None:
    text = DOCS[doc].read_text()
    paths = set(re.findall(r"(?<![\w/.])((?:charts|deploy|docs|tests)/[\w./-]+\.(?:ya?ml|json|md|example))", text))
    paths |= {f"charts/epd/ci/{name}" for name in re.findall(r"(?<![\w/])ci/([\w-]+\.yaml)", text)}
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == [], missing


def test_epd_commands_in_docs_parse() -> None:
    parser = epd_parser()
    commands = [line for text in (p.read_text() for p in DOCS.values()) for line in shell_lines(text)
                if line.startswith("epd ")]
    assert any(c.startswith("epd up --ray") for c in commands)
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])


def test_compose_services_named_in_docs_exist() -> None:
    services = set(load_compose()["services"])
    for line in shell_lines(DOCS["docs/deploy.md"].read_text()):
        words = shlex.split(line.split("docker compose", 1)[1]) if "docker compose" in line else []
        if "up" in words:
            named = [w for w in words[words.index("up") + 1:] if not w.startswith("-")]
            assert set(named) <= services, named


def test_chart_readme_documents_every_value() -> None:
    readme = DOCS["charts/epd/README.md"].read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = []
    for path in values_leaf_paths(values):
        generic = re.sub(rf"^({'|'.join(COMPONENTS)})\.", "<c>.", path)
        if f"`{path}`" not in readme and f"`{generic}`" not in readme:
            undocumented.append(path)
    assert undocumented == [], undocumented
