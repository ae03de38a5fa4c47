"""The chart's prefill pool (`prefill.enabled`, charts/epd/ci/pd-prefill-pool-values.yaml): a StatefulSet of
workers with EPD_WORKER_ROLE=prefill behind a headless Service of its own, the workers then decode, the routers get
the threshold and may reach the pool; off by default, where nothing of it renders."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy.support import CHART, env_of, find, load_values, one, render

SCENARIO = CHART / "ci" / "pd-prefill-pool-values.yaml"


def _container(docs: list[dict], kind: str, component: str) -> dict:
    (container,) = one(docs, kind, component)["spec"]["template"]["spec"]["containers"]
    return container


def test_the_pool_prefills_and_the_workers_decode() -> None:
    docs = render(load_values(SCENARIO))
    pool = one(docs, "StatefulSet", "prefill")
    headless = one(docs, "Service", "prefill")
    assert pool["spec"]["replicas"] == 1 and pool["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["clusterIP"] == "None"
    prefill = _container(docs, "StatefulSet", "prefill")
    env = env_of(prefill)
    assert prefill["args"] == ["serve", "worker"] and env["EPD_WORKER_ROLE"] == "prefill"
    assert env["EPD_ADVERTISE_ADDR"] == "$(POD_NAME).demo-epd-prefill.ml.svc.cluster.local:50071"
    assert env["EPD_MAX_NUM_BATCHED_TOKENS"] == "8192" and prefill["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(_container(docs, "StatefulSet", "worker"))["EPD_WORKER_ROLE"] == "decode"
    router = env_of(_container(docs, "Deployment", "router"))
    assert (router["EPD_PD_MIN_PREFILL_TOKENS"], router["EPD_PD_MAX_PREFILL_WAITING"]) == ("1024", "8")
    egress = one(docs, "NetworkPolicy", "router")["spec"]["egress"]
    components = [e["values"] for rule in egress for to in rule.get("to", []) for e in
                  to.get("podSelector", {}).get("matchExpressions", [])]  # fmt: skip
    assert ["encoder", "worker", "prefill"] in components
    assert one(docs, "NetworkPolicy", "prefill") and one(docs, "PodDisruptionBudget", "prefill")


def test_off_by_default() -> None:
    docs = render(None)
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "prefill"]
    assert "EPD_WORKER_ROLE" not in env_of(_container(docs, "StatefulSet", "worker"))
    assert "EPD_PD_MIN_PREFILL_TOKENS" not in env_of(_container(docs, "Deployment", "router"))


@pytest.mark.parametrize(
    ("prefill", "message"),
    [
        ({"enabled": True, "minPrefillTokens": 0}, "at '/prefill/minPrefillTokens': minimum: got 0, want 1"),
        ({"tensorParallelSize": 2}, "at '/prefill': additional properties 'tensorParallelSize' not allowed"),
    ],
)
def test_bad_prefill_values_are_refused_by_the_schema(prefill: dict, message: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"prefill": prefill})
    assert message in str(caught.value)


def test_the_scenario_is_found_by_the_ci_scenarios() -> None:
    assert SCENARIO.exists() and find(render(load_values(SCENARIO)), "StatefulSet", "prefill")
