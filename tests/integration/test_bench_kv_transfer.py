"""`epd bench kv-transfer --quick`: a real decode worker takes every pushed byte, by gRPC and by gloo; the JSON
line's keys."""

from __future__ import annotations

import json

import pytest


def test_kv_transfer_bench_quick_prints_grpc_and_gloo_against_a_memory_copy(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.bench.bench_kv_transfer import main

    assert main(["--quick"]) == 0  # it raises when the worker acknowledged fewer bytes than were sent
    out = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out[-1])
    assert figures["memcpy_mb_s"] > 0 and figures["bytes_per_round"] > 0
    for name in ("grpc", "gloo"):
        transport = figures["transports"][name]
        assert transport["mb_s"] > 0
        assert transport["ratio_to_memcpy"] == pytest.approx(transport["mb_s"] / figures["memcpy_mb_s"])
        assert any(line.startswith(name) for line in out)
    assert len(figures["rounds_mb_s"]) == 3
