"""`epd bench burst --quick`: two real clusters (no target, then a target) run end to end; the JSON line's keys."""

from __future__ import annotations

import json

import pytest


def test_burst_bench_quick_prints_both_runs_in_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.bench.bench_burst import main

    assert main(["--quick", "--itl-target-ms", "5"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert figures["itl_target_ms"] == 5.0
    assert set(figures["stall_ratio"]) == set(figures["throughput_ratio"]) == {"no_target", "target"}
    assert figures["throughput_ratio"]["no_target"] == 1.0 and figures["throughput_ratio"]["target"] > 0
    assert figures["target"]["budgeted_steps"] > 0  # the worker read EPD_ITL_TARGET_MS and sized prefill by it
    for run in ("no_target", "target"):
        got = figures[run]
        assert figures["stall_ratio"][run] == got["stall_ratio"] > 0
        for key in ("quiet_itl_p99_ms", "burst_itl_p99_ms", "burst_itl_max_ms", "typical_worst_stall_ms",
                    "image_ttft_p50_ms", "image_ttft_max_ms", "tokens_per_s"):  # fmt: skip
            assert got[key] > 0, (run, key)
        # a median gap may be 0: tokens made while the worker's event loop was behind arrive as one message of k
        # tokens, k - 1 gaps of 0 (the bench counts them); the percentiles still order
        for phase in ("quiet", "burst"):
            p50, p99, top = (got[f"{phase}_itl_{q}_ms"] for q in ("p50", "p99", "max"))
            assert 0 <= p50 <= p99 <= top, (run, phase)
        assert [len(stalls) for stalls in got["worst_stall_ms"]] == [2] and got["quiet_gaps"] > 0
