"""tests/bench/serve_report.py: the p99 bound read from a histogram's buckets between two scrapes."""

from __future__ import annotations

import math

from tests.bench.serve_report import bucket_p99_ms, lag_line


def test_the_p99_bound_counts_only_the_samples_taken_between_the_scrapes() -> None:
    before = {0.001: 90.0, 0.01: 100.0, 0.1: 100.0, math.inf: 100.0}  # earlier samples, all fast
    after = {0.001: 90.0, 0.01: 110.0, 0.1: 299.0, math.inf: 300.0}  # 200 new: 10 under 10 ms, 189 under 100 ms
    assert bucket_p99_ms(before, after) == 100.0  # 199 of 200 (99.5 %) under 0.1 s
    assert bucket_p99_ms({}, after) == 100.0  # 297 of 300 by 0.1 s
    assert bucket_p99_ms(after, after) is None  # nothing new
    assert bucket_p99_ms(before, {**after, 0.1: 250.0}) == math.inf  # 1 in 4 past the last bound


def test_the_lag_line_says_which_loop_it_measured() -> None:
    assert lag_line("text", {"router_loop_lag_p99_ms": 25.0, "client_loop_lag_p99_ms": 3.14}) == (
        "ours text: event-loop lag p99 router <= 25 ms, this client 3.1 ms"
    )
    assert lag_line("text", {"client_loop_lag_p99_ms": 1.0}) == "ours text: event-loop lag p99 this client 1.0 ms"
    assert lag_line("text", {}) is None
