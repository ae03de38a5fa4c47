"""`epd bench kv-transfer --quick`: a real decode worker takes every pushed byte; the JSON line's keys."""

from __future__ import annotations

import json

import pytest


def test_kv_transfer_bench_quick_prints_grpc_against_a_memory_copy(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.bench.bench_kv_transfer import main

    assert main(["--quick"]) == 0  # it raises when the worker acknowledged fewer bytes than were sent
    out = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out[-1])
    assert figures["memcpy_mb_s"] > 0 and figures["bytes_per_round"] > 0
    grpc = figures["transports"]["grpc"]
    assert grpc["mb_s"] > 0 and grpc["ratio_to_memcpy"] == pytest.approx(grpc["mb_s"] / figures["memcpy_mb_s"])
    assert figures["transports"]["gloo"] is None and any(line.startswith("gloo") for line in out)
    assert len(figures["rounds_mb_s"]) == 3
