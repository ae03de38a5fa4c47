"""`epd bench serve` against the local cluster it starts: three tiny workloads end to end; the JSON's fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.bench_serve import WORKLOADS


def test_serve_bench_measures_every_workload_and_the_routers_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.bench.bench_serve import main

    out = tmp_path / "serve.json"
    assert main(["--num-requests", "6", "--concurrency", "3", "--max-tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out.read_text())
    assert json.loads(printed[-1]) == figures
    assert figures["target"]["started_cluster"] and figures["target"]["router_pid"] > 0
    assert figures["compare"] is None and figures["ratios"] is None
    assert list(figures["workloads"]) == list(WORKLOADS)
    for workload, got in figures["workloads"].items():
        assert got["requests"] == got["completed"] == 6, (workload, got["errors"])
        assert got["refused"] == got["failed"] == 0, workload
        assert got["output_tokens"] == 6 * 8, workload  # eos ignored: every request streamed max_tokens
        assert got["tokens_per_s"] > 0 and got["ttft_p50_ms"] > 0 and got["itl_p50_ms"] >= 0, workload
        assert got["ttft_p99_ms"] >= got["ttft_p50_ms"] and got["itl_p99_ms"] >= got["itl_p50_ms"], workload
        assert got["router_cpu_ms_per_token"] is not None and got["router_cpu_ms_per_token"] > 0, workload
        for key in ("refusal_latency_p50_ms", "refusal_latency_p99_ms", "router_cpu_s", "client_cpu_s", "wall_s"):
            assert key in got, (workload, key)
    assert any(workload in line for line in printed for workload in WORKLOADS)  # the table
    # both event loops' lag over each workload: the router's from its metrics (a bucket bound), this client's own
    lags = [(got["router_loop_lag_p99_ms"], got["client_loop_lag_p99_ms"]) for got in figures["workloads"].values()]
    assert any(router is not None and router >= 1.0 for router, _ in lags), lags
    assert any(client is not None and client >= 0.0 for _, client in lags), lags
    assert any("event-loop lag p99 router <=" in line for line in printed)
