"""services/common/loop_lag.py: a stalled event loop shows in its lag samples, and on the service's endpoint."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest

from services.common import loop_lag
from services.common.telemetry import Telemetry


def test_a_stalled_loop_is_recorded_as_late_and_a_free_one_as_on_time() -> None:
    async def run() -> loop_lag.Samples:
        samples = loop_lag.Samples()
        task = asyncio.create_task(loop_lag.watch(samples, period_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the loop runs nothing else meanwhile: the watcher's wake-up is ~0.2 s late
        await asyncio.sleep(0.05)
        task.cancel()
        return samples

    samples = asyncio.run(run())
    assert len(samples) >= 4
    assert all(s >= 0.0 for s in samples)
    assert max(samples) >= 0.15
    assert sorted(samples)[len(samples) // 2] < 0.1  # the samples around the stall were on time


def test_the_service_endpoint_exports_the_lag_family_and_shutdown_stops_the_watch() -> None:
    async def run() -> str:
        telemetry = Telemetry("test", model_name="m")
        telemetry.watch_loop()
        await asyncio.sleep(0.02)
        time.sleep(0.12)
        await asyncio.sleep(loop_lag.PERIOD_S * 2)
        text = generate_latest(telemetry.registry).decode()
        watch = telemetry._loop_watch
        telemetry.shutdown()
        await asyncio.sleep(0)
        assert watch is not None and watch.cancelled()
        return text

    text = asyncio.run(run())
    assert f'{loop_lag.NAME}_bucket{{le="0.1",model_name="m"}}' in text
    counts = {
        line.split('le="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{loop_lag.NAME}_bucket")
    }
    assert counts["+Inf"] >= 2
    assert counts["+Inf"] - counts["0.05"] >= 1  # the 0.12 s stall: one sample past 50 ms
