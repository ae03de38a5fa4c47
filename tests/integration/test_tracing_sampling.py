"""Sampling ratio 0 exports no span.

A real cluster is configured with an OTLP endpoint (a receiver in this process) and
`OTEL_TRACES_SAMPLER=traceidratio` with ratio 0; requests with and without a sampled `traceparent`
are served; after the cluster stops (each service flushes its exporter on the way out) the receiver
holds no span, while the services' logs show the exporter was configured.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import grpc

from services.client import Client, user_request
from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import generation_pb2_grpc
from services.launch.local import ClusterSpec, start_cluster
from tests import media_factory
from tests.otlp_receiver import OtlpReceiver
from tests.redis_server import RedisServer


def test_ratio_zero_exports_nothing(tiny_model_dir: Path, redis_server: RedisServer) -> None:
    receiver = OtlpReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "EPD_LOG_FORMAT": "json",
    }
    cluster = start_cluster(ClusterSpec(tiny_model_dir, free_ports=True, redis_url=redis_server.url, env=env))
    try:
        image = media_factory.png(160, 120, seed=20)
        with Client(cluster.address) as client:
            answer = client.generate(user_request("Describe the image.", [image], max_tokens=3), timeout_s=120)
            assert len(answer.token_ids) == 3
        sampled = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        with grpc.insecure_channel(cluster.address, options=channel_options()) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = user_request("Describe the image.", [media_factory.png(160, 120, seed=21)], max_tokens=3)
            responses = list(stub.Generate(request, timeout=120, metadata=[("traceparent", sampled)]))
            assert responses[-1].final.usage.completion_tokens == 3
        for process in cluster.processes:
            lines = [json.loads(line) for line in process.log_path.read_text().splitlines() if line.strip()]
            configured = [r["message"] for r in lines if r["message"].startswith("traces to ")]
            assert configured == [f"traces to {receiver.endpoint} (TraceIdRatioBased{{0.0}})"], process.role
    finally:
        cluster.stop()  # each service shuts its TracerProvider down: whatever was buffered is exported now
        receiver.stop()
    assert receiver.spans() == []
