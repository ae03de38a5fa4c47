"""After a benchmark's load: what the cluster still holds (KV blocks, encoder admissions, requests in flight), and
where its refused requests spent their time (the router's `request finished` lines).

`wait_until_idle` polls every worker's and encoder's published state in the registry and the router's
`epd_router_requests_in_flight` until nothing is held or a timeout passes: reserved KV blocks, running and waiting
requests and pinned embeddings at each worker; admitted items and tokens, preprocessing slots and items waiting
for a tower call at each encoder. A leak is anything still held once every request has ended.
`refusal_profile` reads the router's JSON log lines of requests that ended RESOURCE_EXHAUSTED, grouped by refusal
reason: how many, their time in the router (p50/p99), and when they passed intake, the cache lookup and placement.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from services.common.registry import Registry
from tests.bench.workload import percentile

WORKER_HELD = ("reserved_blocks", "running", "waiting", "pinned_embeddings")
ENCODER_HELD = ("queued_items", "queued_tokens", "preprocess_outstanding", "batch_queue_items")
ROUTER_IN_FLIGHT = "epd_router_requests_in_flight"
STEPS = ("intake_at_s", "lookup_at_s", "placed_at_s")


def _scrape(port: int) -> str:
    """The Prometheus endpoint's text on 127.0.0.1:`port`."""
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def metric_sum(port: int, name: str, label: str = "") -> float:
    """The sum of the samples of `name` (those whose labels contain `label`) on a Prometheus endpoint."""
    text = _scrape(port)
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_buckets(port: int, name: str) -> dict[float, float]:
    """Histogram `name`'s cumulative bucket counts by upper bound (`+Inf` as infinity), summed over its labels."""
    text = _scrape(port)
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{") and 'le="' in line:
            bound = float(line.split('le="', 1)[1].split('"', 1)[0])  # float("+Inf") is infinity
            out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def metric_by_label(port: int, name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed per value of `label` (e.g. refusals by reason)."""
    text = _scrape(port)
    out: dict[str, float] = {}
    key = f'{label}="'
    for line in text.splitlines():
        if line.startswith(name + "{") and key in line:
            value = line.split(key, 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def held(redis_url: str, router_metrics_port: int = 0) -> dict[str, int]:
    """What the cluster holds now: each figure summed over the services that publish it."""
    registry = Registry(redis_url)
    try:
        workers = registry.members("worker") or []
        encoders = registry.members("encoder") or []
    finally:
        registry.close()
    out = {f"worker_{k}": sum(int(m.state.get(k, 0)) for m in workers) for k in WORKER_HELD}
    out |= {f"encoder_{k}": sum(int(m.state.get(k, 0)) for m in encoders) for k in ENCODER_HELD}
    out["workers"], out["encoders"] = len(workers), len(encoders)
    if router_metrics_port:
        out["router_in_flight"] = round(metric_sum(router_metrics_port, ROUTER_IN_FLIGHT))
    return out


def leaked(state: dict[str, int]) -> dict[str, int]:
    """The figures of `state` that are not zero (the service counts aside)."""
    return {k: v for k, v in state.items() if v and k not in ("workers", "encoders")}


def wait_until_idle(
    redis_url: str, router_metrics_port: int = 0, timeout_s: float = 60.0, settle_s: float = 1.0
) -> dict[str, Any]:
    """Poll `held` until nothing is held for `settle_s` (a heartbeat or two: published states are that old) or
    `timeout_s` passes; returns the last state, how long it took and what is still held (`leaked`)."""
    start = time.monotonic()
    quiet_since: float | None = None
    while True:
        state = held(redis_url, router_metrics_port)
        now = time.monotonic()
        if leaked(state) or not state["workers"]:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        if (quiet_since is not None and now - quiet_since >= settle_s) or now - start >= timeout_s:
            return {"state": state, "leaked": leaked(state), "waited_s": round(now - start, 2)}
        time.sleep(0.1)


def log_size(path: Path) -> int:
    """The log's length in bytes now (`refusal_profile` reads what is written after it)."""
    return path.stat().st_size if path.exists() else 0


def refusal_profile(router_log: Path, offset: int = 0) -> dict[str, dict[str, Any]]:
    """Refused requests (RESOURCE_EXHAUSTED) in a router's JSON log from byte `offset` on, by refusal reason: the
    count, `total_s` (the router's own time, from its generation path's start to the refusal) p50/p99 in ms, and
    when they passed each step they reached (`STEPS`), p50/p99 in ms."""
    with router_log.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for raw in text.splitlines():
        if '"request finished"' not in raw:
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("status") == "resource_exhausted":
            by_reason.setdefault(line.get("refusal") or "unlabelled", []).append(line)
    out: dict[str, dict[str, Any]] = {}
    for reason, lines in sorted(by_reason.items()):
        totals = [1000 * float(line["total_s"]) for line in lines]
        entry: dict[str, Any] = {
            "count": len(lines),
            "router_p50_ms": percentile(totals, 50),
            "router_p99_ms": percentile(totals, 99),
        }
        for step in STEPS:
            reached = [1000 * float(line[step]) for line in lines if step in line]
            if reached:
                name = step.removesuffix("_s")
                entry[f"{name}_p50_ms"] = percentile(reached, 50)
                entry[f"{name}_p99_ms"] = percentile(reached, 99)
        out[reason] = entry
    return out
