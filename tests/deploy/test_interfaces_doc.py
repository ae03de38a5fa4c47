"""docs/interfaces.md's settings tables agree with the config dataclasses: names, services, defaults."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from services.common.config import env_name
from services.encoder.config import EncoderConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from tests.deploy.support import REPO

CONFIGS = {"router": RouterConfig, "encoder": EncoderConfig, "worker": WorkerConfig}
ROW = re.compile(r"^\|\s*(EPD_[A-Z0-9_]+)\s*\|([^|]*)\|([^|]*)\|([^|]*)\|\s*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Row:
    readers: set[str]
    default: str


def documented() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for name, readers, default, _meaning in ROW.findall((REPO / "docs" / "interfaces.md").read_text()):
        assert name not in rows, f"{name} has two rows"
        roles = set(CONFIGS) if readers.strip() == "all" else {r.strip() for r in readers.split(",")}
        rows[name] = Row(roles, default.strip())
    return rows


def defaults() -> dict[str, dict[str, Any]]:
    """EPD_* name -> {service: default} from the dataclasses."""
    found: dict[str, dict[str, Any]] = {}
    for role, cls in CONFIGS.items():
        for field in dataclasses.fields(cls):
            value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            found.setdefault(env_name(field.name), {})[role] = value
    return found


def shown(value: Any) -> str:
    """How a default is written in the table (its first word)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "(empty"
    return str(value)


def test_every_setting_has_exactly_one_row() -> None:
    rows, fields = documented(), defaults()
    assert sorted(set(fields) - set(rows)) == [], "add a row to docs/interfaces.md for these settings"
    assert sorted(set(rows) - set(fields)) == [], "docs/interfaces.md documents settings no config has"


@pytest.mark.parametrize("name", sorted(defaults()))
def test_row_names_the_services_and_the_default(name: str) -> None:
    row, by_role = documented()[name], defaults()[name]
    assert row.readers == set(by_role), f"{name}: read by {sorted(by_role)}"
    values = set(map(shown, by_role.values()))
    if values == {""}:
        return  # no default (the model) or a derived one (the advertised address)
    if len(values) == 1:
        assert row.default.startswith(values.pop()), f"{name}: default {by_role}"
    else:
        for role, value in by_role.items():
            assert f"{role} {shown(value)}" in row.default, f"{name}: default {by_role}"
