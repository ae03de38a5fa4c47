"""docs/api.md run as written against a real cluster: every bash and python block in it.

The only change made to a block is the address (`http://localhost:8000` and `localhost:50051` become the test
cluster's), so a command in the doc that stops working, or stops answering what it claims, fails here. The
grpcurl example cannot run here (grpcurl is a Go binary no reachable registry carries): its request body
and method are checked against the Python block that sends the same body through the same reflection.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.launch.local import ClusterSpec, LocalCluster, start_cluster
from tests import media_factory
from tests.integration.conftest import RedisServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
SECTION = "## HTTP API (OpenAI-compatible)"
DOC_URL = "http://localhost:8000"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# What each bash block must print, keyed by a phrase only that block has.
EXPECT = {
    "/health": ['"status":"ok"', '"object":"list"'],
    "jq -r": ['"object":"chat.completion"', '"image_tokens"'],
    "request.json": ['"object":"chat.completion.chunk"', '"usage":{', "data: [DONE]", '"object":"token_count"'],
    "10.0.0.1": ['"code":"invalid_argument"', "private address 10.0.0.1"],
    '"structured_outputs": {"choice"': ['"object":"chat.completion"', '"object":"text_completion"'],
    '"tool_choice": "required"': ['"finish_reason":"tool_calls"', '"tool_calls":[', '"name":"get_weather"'],
    "/detokenize": [
        '"object":"text_completion"',
        '"token_strs":[',
        '"prompt":"The capital of France is"',
        '"version":',
    ],
}


def blocks(section: str = SECTION) -> list[tuple[str, str]]:
    """(language, code) of every fenced block in ``section``, in order."""
    text = DOC.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    return FENCE.findall(text[start : end if end >= 0 else len(text)])


def bash_blocks() -> list[str]:
    return [code for language, code in blocks() if language == "bash"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, redis_server: RedisServer, tmp_path_factory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        tiny_model_dir, redis_url=redis_server.url, free_ports=True, log_dir=tmp_path_factory.mktemp("logs")
    )
    local = start_cluster(spec)
    try:
        _router_sees_a_worker(local.http_url)
        yield local
    finally:
        local.stop()


def _router_sees_a_worker(url: str, timeout_s: float = 60.0) -> None:
    """Wait for the router's /health to answer ok: healthy services are not yet in the router's view of the
    registry (a worker registers just after it serves; the view refreshes every 0.1 s), and the guide's first
    block checks /health."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url}/health never answered ok")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "cat.jpg").write_bytes(media_factory.jpeg(160, 120, seed=3))
    return tmp_path


def test_every_block_is_run_and_checked() -> None:
    languages = [language for language, _ in blocks()]
    assert set(languages) == {"bash", "python"}, "only bash and python blocks can be run here"
    for code in bash_blocks():
        keys = [key for key in EXPECT if key in code]
        assert len(keys) == 1, f"give this block exactly one entry in EXPECT:\n{code}"


@pytest.mark.parametrize("index", range(len(bash_blocks())))
def test_bash_block(cluster: LocalCluster, workdir: Path, index: int) -> None:
    code = bash_blocks()[index].replace(DOC_URL, cluster.http_url)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], cwd=workdir, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (key,) = [key for key in EXPECT if key in code]
    for needle in EXPECT[key]:
        assert needle in done.stdout, (needle, done.stdout[-2000:])


def test_python_blocks(cluster: LocalCluster, workdir: Path) -> None:
    """The python blocks, in order, as one script (later blocks use the client and messages of the first)."""
    script = "\n".join(code for language, code in blocks() if language == "python")
    done = subprocess.run(
        [sys.executable, "-c", script.replace(DOC_URL, cluster.http_url)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) >= 2 + 2 + 3, done.stdout  # answer and usage; stream and usage; three choices
    firsts = [line.split(" ", 1)[0] for line in lines]
    assert any(firsts[i : i + 3] == ["0", "1", "2"] for i in range(len(firsts) - 2)), done.stdout  # n=3
    assert sum("get_weather" in line for line in lines) >= 2, done.stdout  # the tool call, whole and streamed


GRPC_SECTION = "## gRPC API"
DOC_ADDRESS = "localhost:50051"


def test_grpc_blocks_are_all_known() -> None:
    assert [language for language, _ in blocks(GRPC_SECTION)] == [
        "python",
        "python",
        "python",
        "bash",
        "text",
        "python",
    ]


def test_grpc_python_blocks(cluster: LocalCluster, workdir: Path) -> None:
    """The python blocks, in order, as one script: CountTokens and a streamed answer, three seeded samples with
    logprobs, then reflection and the grpcurl body."""
    script = "\n".join(code for language, code in blocks(GRPC_SECTION) if language == "python")
    done = subprocess.run([sys.executable, "-c", script.replace(DOC_ADDRESS, cluster.address)], cwd=workdir,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("prompt ") and " image " in out.splitlines()[0], out
    assert [line.split(" ", 1)[0] for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ")] == ["0", "1", "2"]
    assert "'epd.v1.Generation'" in out and "'grpc.health.v1.Health'" in out
    assert "['Generate', 'CountTokens']" in out


def test_grpc_stub_generation_block(workdir: Path) -> None:
    (workdir / "proto").symlink_to(DOC.parents[1] / "proto")
    (code,) = [code for language, code in blocks(GRPC_SECTION) if language == "bash"]
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code.replace("python ", f"{sys.executable} ")],
                          cwd=workdir, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "generation_pb2_grpc.py" in done.stdout and "common_pb2.py" in done.stdout


def test_grpcurl_example_sends_what_the_python_block_sends() -> None:
    import json

    (grpcurl,) = [code for language, code in blocks(GRPC_SECTION) if language == "text"]
    body = re.search(r"-d '(.*?)'", grpcurl, re.DOTALL).group(1)
    (python,) = [code for language, code in blocks(GRPC_SECTION) if language == "python" and "grpcurl" not in code
                 and "reflection" in code]  # fmt: skip
    sent = re.search(r"body = '(.*)'", python).group(1)
    assert json.loads(body) == json.loads(sent)
    assert grpcurl.rstrip().endswith(f"{DOC_ADDRESS} epd.v1.Generation/Generate")
