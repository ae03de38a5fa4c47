"""Grafana dashboard, Prometheus rules and env examples: well formed, PromQL that parses, agreed names."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from services.common.config import load
from services.worker.config import WorkerConfig
from tests.deploy.support import REPO, interface_env_names

DASHBOARD = REPO / "deploy" / "grafana" / "epd-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "epd-rules.yaml"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
METRIC = re.compile(r"\bepd_[a-z0-9_]+")
COMPOSE_ONLY_VARS = {"EPD_IMAGE", "EPD_GPU_IMAGE", "EPD_BIND", "EPD_MODELS", "EPD_GPU_KV_CACHE_BYTES"}


def parse(expr: str) -> None:
    """Parse PromQL, with Grafana's interval variable replaced as Grafana would."""
    promql_parser.parse(expr.replace("$__rate_interval", "5m"))


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\|\s*`(epd_[a-z0-9_]+)`", DEPLOY_DOC.read_text(), flags=re.MULTILINE))


def base_name(metric: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", metric)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_panels_are_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "epd-overview" and board["title"] == "epd"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in board["panels"] if p["type"] == "timeseries"]
    assert len(graphs) >= 12
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            parse(target["expr"])


def test_rules_parse_and_alerts_are_labelled() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    records = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert len(records) >= 5 and len(alerts) >= 5
    for group in groups:
        for rule in group["rules"]:
            parse(rule["expr"])
    for record in records:
        assert re.fullmatch(r"epd:[a-z0-9_]+:[a-z0-9_]+", record), record
    for alert in alerts:
        assert alert["labels"]["severity"] in {"warning", "critical"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
        assert set(re.findall(r"epd:[a-z0-9_:]+", alert["expr"])) <= records


def test_bad_promql_is_refused() -> None:
    with pytest.raises(ValueError):
        parse("sum(rate(epd_x_total[5m])")


def test_every_metric_used_is_documented() -> None:
    used = {base_name(m) for m in METRIC.findall(DASHBOARD.read_text() + RULES.read_text())}
    documented = documented_metrics()
    assert documented, "docs/deploy.md has no metrics table"
    assert used <= documented, sorted(used - documented)


@pytest.mark.parametrize("example", sorted((REPO / "deploy" / "env").glob("*.example")), ids=lambda p: p.name)
def test_env_examples_use_agreed_names(example: Path) -> None:
    names = re.findall(r"^(EPD_[A-Z0-9_]+)=", example.read_text(), flags=re.MULTILINE)
    assert names
    allowed = interface_env_names() | (COMPOSE_ONLY_VARS if example.name.startswith("compose") else set())
    assert set(names) <= allowed, sorted(set(names) - allowed)
    if example.name.startswith("compose"):
        compose_text = (REPO / "docker-compose.yml").read_text()
        assert all("${" + name + ":-" in compose_text for name in names), names


def test_worker_env_example_is_valid_and_shows_the_defaults() -> None:
    text = (REPO / "deploy" / "env" / "worker.env.example").read_text()
    env = dict(re.findall(r"^(EPD_[A-Z0-9_]+)=(.*)$", text, flags=re.MULTILINE))
    example = load(WorkerConfig, env=env)  # validates, e.g. EPD_GPU_MEMORY_UTILIZATION within (0, 1]
    defaults = WorkerConfig(model=example.model)
    differ = {f.name for f in dataclasses.fields(WorkerConfig) if getattr(example, f.name) != getattr(defaults, f.name)}
    assert differ == {"device", "dtype"}, differ  # as its header says (EPD_MODEL has no default)
    assert {
        "EPD_GPU_MEMORY_UTILIZATION",
        "EPD_CUDA_GRAPHS",
        "EPD_ATTENTION_BACKEND",
        "EPD_BLOCK_SIZE",
        "EPD_KV_CACHE_BYTES",
    } <= set(env)


def test_env_examples_share_one_redis_and_list_no_workers() -> None:
    urls = {}
    for role in ("router", "encoder", "worker"):
        text = (REPO / "deploy" / "env" / f"{role}.env.example").read_text()
        urls[role] = re.findall(r"^EPD_REDIS_URL=(.*)$", text, flags=re.MULTILINE)
        assert "EPD_WORKER_ADDRS" not in text, role
    assert all(len(found) == 1 for found in urls.values()), urls
    assert len({found[0] for found in urls.values()}) == 1, urls
