"""services/common/telemetry.py: histogram buckets by name, one registry per Telemetry."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client import generate_latest

from services.common.telemetry import BATCH_SIZE_BUCKETS, SECONDS_BUCKETS, TOKEN_BUCKETS, Telemetry
from services.launch.local import free_port


def bounds(text: str, name: str) -> list[float]:
    found = re.findall(rf'^{name}_bucket\{{le="([^"]+)"', text, flags=re.MULTILINE)
    return [float(b) for b in found if b != "+Inf"]


def test_histograms_get_buckets_by_name() -> None:
    telemetry = Telemetry("test")
    try:
        meter = telemetry.meter
        meter.create_histogram("epd_x_time_seconds", unit="s").record(0.02)
        meter.create_histogram("epd_x_batch_size", explicit_bucket_boundaries_advisory=[1, 2]).record(3)
        meter.create_histogram("epd_x_batch_tokens").record(100)
        meter.create_histogram("epd_x_other", explicit_bucket_boundaries_advisory=[7.0]).record(1)
        meter.create_counter("epd_x_seconds").add(1)  # counters keep their sum aggregation
        text = generate_latest(telemetry.registry).decode()
    finally:
        telemetry.shutdown()
    assert bounds(text, "epd_x_time_seconds") == list(SECONDS_BUCKETS)
    assert bounds(text, "epd_x_batch_size") == list(BATCH_SIZE_BUCKETS)
    assert bounds(text, "epd_x_batch_tokens") == list(TOKEN_BUCKETS)
    assert bounds(text, "epd_x_other") == [7.0]
    assert re.search(r"^epd_x_seconds_total\{.*\} 1\.0$", text, flags=re.MULTILINE)


def test_seconds_buckets_span_1ms_to_2min_log_spaced() -> None:
    assert SECONDS_BUCKETS[0] == 0.001 and SECONDS_BUCKETS[-1] == 120.0
    ratios = [b / a for a, b in zip(SECONDS_BUCKETS, SECONDS_BUCKETS[1:], strict=False)]
    assert all(1.2 <= r <= 2.6 for r in ratios), ratios


def test_each_service_serves_only_its_own_metrics() -> None:
    ports = free_port(), free_port()
    first, second = Telemetry("a", metrics_port=ports[0]), Telemetry("b", metrics_port=ports[1])
    try:
        first.meter.create_counter("epd_only_a").add(1)
        second.meter.create_counter("epd_only_b").add(1)
        texts = [urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode() for p in ports]
    finally:
        first.shutdown()
        second.shutdown()
    assert "epd_only_a_total" in texts[0] and "epd_only_b" not in texts[0]
    assert "epd_only_b_total" in texts[1] and "epd_only_a" not in texts[1]
    assert "process_resident_memory_bytes" in texts[0]


def test_a_fast_histogram_exports_what_an_otel_histogram_of_its_name_does() -> None:
    """The per-token kind (services/common/fast_histogram.py): same buckets by name, same samples and labels, for
    values on, between, below and above the bounds."""
    telemetry = Telemetry("router", model_name="m")
    try:
        otel = telemetry.meter.create_histogram("epd_a_latency_seconds", unit="s", description="d")
        fast = telemetry.fast_histogram("epd_b_latency_seconds", "d")
        for value in (0.0005, 0.001, 0.0011, 0.02, 0.3, 120.0, 500.0):
            otel.record(value)
            fast.record(value)
        text = generate_latest(telemetry.registry).decode()
    finally:
        telemetry.shutdown()

    def family(prefix: str) -> list[str]:
        return [line.replace(prefix, "X") for line in text.splitlines() if prefix in line]

    assert family("epd_a_") == family("epd_b_")
    assert bounds(text, "epd_b_latency_seconds") == list(SECONDS_BUCKETS)
    assert 'epd_b_latency_seconds_count{model_name="m"} 7.0' in text
