"""The soak benchmark (`epd bench soak`), shortened: three minutes of mixed traffic with a fault every 30 s
(each of the five kinds once).

Marked slow, so not in the default run (pyproject's `-m "not slow"`); run it with
`pytest -m slow tests/integration/test_soak.py`. The full 20 minutes is `epd bench soak` (tests/bench/bench_soak.py).
"""

from __future__ import annotations

import pytest

from tests.bench.bench_soak import run_soak


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_soak_loses_nothing_and_leaks_nothing() -> None:
    # fd_slack: in three minutes the services' Redis connection pools (one descriptor per connection, up to
    # the thread pool's size) may still be filling; a fault-free probe shows them flat once full
    figures = run_soak(
        duration_s=180, kill_every_s=30, clients=4, images=24, warm_up_s=60, sample_every_s=5, flat=0.10, fd_slack=8
    )
    assert figures["requests"] > 0 and figures["faults"] >= 5, figures
    assert figures["failed"] == 0, (figures["failed_by_status"], figures["failed_examples"])
    assert figures["restarts"] >= 2, figures["events"]
    assert figures["workers_settled"], figures["settled_error"]
    assert figures["worst_rss_growth"] <= 0.10, figures["series"]
    assert figures["fds_flat"], figures["series"]
