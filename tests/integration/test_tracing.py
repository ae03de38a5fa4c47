"""One trace across router, encoder and worker; request ids in and out; JSON logs.

One real cluster (router, encoder, worker processes, a private Redis) exports its spans over OTLP/gRPC
to a receiver in this process (`tests/otlp_receiver.py`) and writes JSON logs. Each request carries a
W3C `traceparent` of its own, so its spans are found by trace id.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.client import user_request
from services.common.grpc_server import channel_options
from services.common.rpc.epd.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from tests import media_factory
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.redis_server import RedisServer

PROMPT = "Describe the secret-prompt-words image."
WAIT_S = 60.0


@dataclass
class Traced:
    cluster: LocalCluster
    receiver: OtlpReceiver
    image: bytes


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[Traced]:
    receiver = OtlpReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms of a span's end
        "EPD_LOG_FORMAT": "json",
    }
    cluster = start_cluster(ClusterSpec(tiny_model_dir, free_ports=True, redis_url=redis_server.url, env=env))
    try:
        yield Traced(cluster, receiver, media_factory.png(160, 120, seed=18))
    finally:
        cluster.stop()
        receiver.stop()


def traceparent() -> tuple[str, str, str]:
    """A fresh sampled W3C traceparent: (header, trace id, parent span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def generate(address: str, request: generation_pb2.GenerateRequest, metadata: list[tuple[str, str]]):
    """(responses, the call's initial metadata) of one Generate call; an RpcError propagates."""
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120, metadata=metadata)
        responses = list(call)
        return responses, dict(call.initial_metadata())


def spans_until(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> list[ReceivedSpan]:
    """The trace's spans once every name in `names` has arrived (fails after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        spans = receiver.spans(trace_id)
        if names <= {s.name for s in spans}:
            return spans
        time.sleep(0.1)
    pytest.fail(f"spans {sorted(names - {s.name for s in receiver.spans(trace_id)})} never arrived")


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def ancestors(spans: list[ReceivedSpan], span: ReceivedSpan) -> list[str]:
    """Names of `span`'s ancestors within the trace, nearest first."""
    by_id = {s.span_id: s for s in spans}
    names = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        names.append(span.name)
    return names


def test_one_trace_spans_router_encoder_and_worker(traced: Traced) -> None:
    header, trace_id, parent = traceparent()
    request = user_request(PROMPT, [traced.image], max_tokens=6)
    request.sampling.ignore_eos = True
    responses, initial = generate(
        traced.cluster.address, request, [("traceparent", header), ("x-request-id", "req-trace-1")]
    )
    assert initial.get("x-request-id") == "req-trace-1"  # echoed
    assert responses[-1].final.request_id == "req-trace-1"
    names = {"llm_request", "intake", "admission", "encode", "encode.tower", "embedding_push", "worker.decode"}
    spans = spans_until(traced.receiver, trace_id, names)

    assert {"epd-router", "epd-encoder", "epd-worker"} <= {s.service for s in spans}
    root = one(spans, "llm_request")
    assert root.service == "epd-router" and root.parent_id == parent  # under the client's span
    assert root.attributes["gen_ai.request.id"] == "req-trace-1"
    assert root.attributes["gen_ai.request.max_tokens"] == 6
    assert root.attributes["gen_ai.usage.completion_tokens"] == 6
    assert root.attributes["gen_ai.usage.prompt_tokens"] == responses[-1].final.usage.prompt_tokens
    assert root.attributes["epd.status"] == "ok" and root.attributes["epd.worker"]
    for name in ("intake", "admission", "encode", "embedding_push", "worker.queue", "worker.prefill", "worker.decode"):
        assert "llm_request" in ancestors(spans, one(spans, name)), name
    encode = one(spans, "encode")
    assert encode.service == "epd-encoder"
    assert encode.attributes["epd.items"] == 1 and encode.attributes["epd.encoded"] == 1
    assert encode.attributes["epd.encoder_tokens"] == responses[-1].final.usage.image_tokens
    for stage in ("encode.preprocess", "encode.tower"):
        assert ancestors(spans, one(spans, stage))[0] == "encode", stage
        assert one(spans, stage).attributes["epd.encoder_tokens"] == encode.attributes["epd.encoder_tokens"]
    tower_calls = batches_linked_to(traced.receiver, (trace_id, encode.span_id))
    assert [b.attributes["epd.batch_size"] for b in tower_calls] == [1] and tower_calls[0].service == "epd-encoder"
    push = one(spans, "embedding_push")
    assert push.attributes["epd.push.bytes"] > 0 and push.attributes["epd.push.transport"] == "grpc"
    assert "encode" in ancestors(spans, push)
    admission = one(spans, "admission")
    assert (
        admission.attributes["epd.worker"] == root.attributes["epd.worker"] and admission.attributes["epd.blocks"] > 0
    )
    prefill = one(spans, "worker.prefill")
    assert prefill.service == "epd-worker"
    assert prefill.attributes["gen_ai.usage.prompt_tokens"] == root.attributes["gen_ai.usage.prompt_tokens"]
    assert one(spans, "worker.decode").attributes["gen_ai.usage.completion_tokens"] == 6
    for stage in ("intake_s", "encode_decode_s", "encode_tower_s", "encode_push_s", "prefill_s"):
        assert root.attributes[f"epd.stage.{stage}"] > 0, stage  # each stage's time on the request's span
    assert_no_text(spans)


def batches_linked_to(receiver: OtlpReceiver, link: tuple[str, str]) -> list[ReceivedSpan]:
    """The `encode.batch` spans (tower calls, each its own trace) linked to the span `link`, once one arrived."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = [s for s in receiver.spans() if s.name == "encode.batch" and link in s.links]
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"no encode.batch span links to {link}")


def assert_no_text(spans: list[ReceivedSpan]) -> None:
    """No prompt words and no bytes in any attribute."""
    for span in spans:
        for key, value in span.attributes.items():
            assert not isinstance(value, bytes), (span.name, key)
            assert "secret-prompt-words" not in str(value), (span.name, key)


def test_an_image_from_the_cache_has_no_encode_span(traced: Traced) -> None:
    warm, warm_id, _ = traceparent()
    generate(traced.cluster.address, user_request(PROMPT, [traced.image], max_tokens=2), [("traceparent", warm)])
    spans_until(traced.receiver, warm_id, {"llm_request", "worker.decode"})
    header, trace_id, _ = traceparent()
    responses, _ = generate(
        traced.cluster.address, user_request("Again.", [traced.image], max_tokens=2), [("traceparent", header)]
    )
    assert responses[-1].final.usage.image_tokens > 0
    spans = spans_until(traced.receiver, trace_id, {"llm_request", "worker.prefill", "worker.decode"})
    assert not {"encode", "embedding_push"} & {s.name for s in spans}


def test_a_video_has_its_preprocess_and_tower_stages(traced: Traced) -> None:
    """A video's encode span has the same two stages as an image's, saying the frames and where they came from."""
    header, trace_id, _ = traceparent()
    content = [
        generation_pb2.ContentPart(video=generation_pb2.Media(data=media_factory.video(64, 48, seconds=2.0, seed=31))),
        generation_pb2.ContentPart(text=PROMPT),
    ]
    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.Message(role="user", content=content)],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    responses, _ = generate(traced.cluster.address, request, [("traceparent", header)])
    video_tokens = responses[-1].final.usage.video_tokens
    assert video_tokens > 0
    spans = spans_until(traced.receiver, trace_id, {"encode", "encode.preprocess", "encode.tower"})
    for stage in ("encode.preprocess", "encode.tower"):
        span = one(spans, stage)
        assert ancestors(spans, span)[0] == "encode", stage
        assert span.attributes["epd.modality"] == "video"
        assert span.attributes["epd.encoder_tokens"] == video_tokens
    preprocess = one(spans, "encode.preprocess")
    assert preprocess.attributes["epd.frames"] == 4  # 2 s sampled at the tiny model's 2 frames a second
    assert preprocess.attributes["epd.frames_from"] == "decoded"


def test_http_traceparent_and_request_id(traced: Traced) -> None:
    header, trace_id, parent = traceparent()
    body = {"messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 2}
    http = urllib.request.Request(
        f"{traced.cluster.http_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "traceparent": header, "X-Request-Id": "req-http-1"},
    )
    with urllib.request.urlopen(http, timeout=120) as answer:
        assert answer.headers["X-Request-Id"] == "req-http-1"
        assert json.loads(answer.read())["id"] == "chatcmpl-req-http-1"
    spans = spans_until(traced.receiver, trace_id, {"llm_request", "worker.decode"})
    root = one(spans, "llm_request")
    assert root.parent_id == parent and root.attributes["gen_ai.request.id"] == "req-http-1"


def finished_lines(path: Path, request_id: str) -> list[dict[str, Any]]:
    """The router's `request finished` lines for `request_id`, once there is one (fails after WAIT_S);
    every line of the log must be one JSON object."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        found = [r for r in lines if r["message"] == "request finished" and r["request_id"] == request_id]
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"no finished line for {request_id}")


def test_json_logs_carry_ids_and_status_of_a_failed_request(traced: Traced) -> None:
    header, trace_id, _ = traceparent()
    refused = user_request(PROMPT, max_tokens=2)
    refused.messages[0].content.insert(
        0, generation_pb2.ContentPart(image=generation_pb2.Media(url="http://127.0.0.1:1/cat.png"))
    )
    with pytest.raises(grpc.RpcError) as failed:
        generate(traced.cluster.address, refused, [("traceparent", header), ("x-request-id", "req-fail-1")])
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    router = next(p for p in traced.cluster.processes if p.role == "router")
    [line] = finished_lines(router.log_path, "req-fail-1")
    assert line["status"] == "invalid_argument" and line["trace_id"] == trace_id
    assert line["service"] == "router" and line["level"] == "INFO"
    spans = spans_until(traced.receiver, trace_id, {"llm_request", "intake", "fetch"})
    root = one(spans, "llm_request")
    assert root.status_code == 2 and root.attributes["epd.status"] == "invalid_argument"  # 2: STATUS_CODE_ERROR
    fetch = one(spans, "fetch")
    assert ancestors(spans, fetch)[:2] == ["intake", "llm_request"]
    assert fetch.attributes["server.address"] == "127.0.0.1" and fetch.attributes["epd.refusal.reason"]
    for process in traced.cluster.processes:  # every service's log parses line by line
        lines = [text for text in process.log_path.read_text().splitlines() if text.strip()]
        assert lines and [text for text in lines if not is_json_object(text)] == [], process.role


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_a_finished_line_names_worker_encoder_tokens_and_timings(traced: Traced) -> None:
    image = media_factory.png(160, 120, seed=1818)  # not cached yet: an encoder encodes it
    responses, _ = generate(
        traced.cluster.address, user_request(PROMPT, [image], max_tokens=3), [("x-request-id", "req-ok-1")]
    )
    usage = responses[-1].final.usage
    router = next(p for p in traced.cluster.processes if p.role == "router")
    [line] = finished_lines(router.log_path, "req-ok-1")
    encoder = next(p for p in traced.cluster.processes if p.role == "encoder")
    worker = next(p for p in traced.cluster.processes if p.role == "worker")
    assert line["status"] == "ok" and line["prompt_tokens"] == usage.prompt_tokens
    assert line["completion_tokens"] == usage.completion_tokens
    assert line["worker"] == worker.address and line["encoders"] == encoder.address
    assert line["total_s"] >= line["first_token_s"] > 0 and "queue_s" in line and "encode_s" in line
    # the fresh image's stages: each measured (> 0) by the service that ran it, none longer than the request
    stages = ("intake_s", "encode_decode_s", "encode_prepare_s", "encode_tower_s", "encode_cache_write_s")
    for stage in (*stages, "encode_push_s", "embedding_wait_s", "prefill_s"):
        assert 0 < line[stage] <= line["total_s"], (stage, line)
    assert line["encode_decode_s"] + line["encode_prepare_s"] + line["encode_tower_s"] <= line["encode_s"]
    assert line["embedding_wait_s"] <= line["prefill_s"]  # the prefill waited for the embedding, then ran
    final_stages = responses[-1].final.timing.encode_stages  # the client's Final carries the same figures
    assert final_stages.tower_s == pytest.approx(line["encode_tower_s"], abs=1e-5)
    generate(traced.cluster.address, user_request(PROMPT, [image], max_tokens=3), [("x-request-id", "req-ok-2")])
    [again] = finished_lines(router.log_path, "req-ok-2")
    assert not [name for name in again if name.startswith("encode_") and name != "encode_s"]  # a hit: no encoder
    assert PROMPT not in router.log_path.read_text()
