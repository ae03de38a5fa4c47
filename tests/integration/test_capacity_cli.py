"""`epd profile --quick`, `epd plan` on its profile, and `epd bench traffic`, as a user runs them (each starts its
own cluster and private Redis on free ports): the files and JSON lines they write have the documented keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.capacity.profile import TRANSPORTS, load_profile

TRAFFIC = """
requests:
  - {images: ["300x200"], text_tokens: 40, output_tokens: 4, share: 0.5}
  - {text_tokens: 30, output_tokens: 6, share: 0.5}
reuse: 0.5
concurrency: 1
"""


def _epd(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_profile_plan_and_traffic_bench(tiny_model_dir: Path, tmp_path: Path) -> None:
    profile_path = tmp_path / "profile.json"
    out = _epd("profile", "--quick", "--model", str(tiny_model_dir), "--out", str(profile_path)).stdout
    assert f"profile written to {profile_path}" in out
    data = json.loads(profile_path.read_text())
    assert data["schema"] == "epd-profile-v1" and data["dtype"] == "float32"
    assert set(data["fits"]) == {"prepare", "tower", "prefill", "decode", "serving", "transports"}
    assert set(data["fits"]["transports"]) == set(TRANSPORTS) == set(data["megabytes_per_s"])
    assert set(data["points"]) == {"vision", "prefill", "decode", "transfer", "serving"}
    assert {"tokens", "megapixels", "prepare_s", "tower_s"} <= set(data["points"]["vision"][0])
    assert {"batch", "context", "step_s"} <= set(data["points"]["decode"][0])
    assert {"measured_s", "parts_s", "residual_s", "output_tokens", "image_tokens"} <= set(data["points"]["serving"][0])
    assert data["hardware"]["device"] == "cpu" and data["model"]["model_type"] == "qwen2_vl"
    profile = load_profile(profile_path)
    assert profile.decode(batch=1, context=100) > 0 and profile.tower(tokens=100) > 0

    traffic = tmp_path / "traffic.yaml"
    traffic.write_text(TRAFFIC)
    plan = json.loads(
        _epd(
            "plan", "--model", str(tiny_model_dir), "--traffic", str(traffic), "--profile", str(profile_path), "--json"
        ).stdout
    )
    assert plan["times"]["request_s_disaggregated"] > 0 and plan["deployment"]["workers"] == 1

    bench = _epd(
        "bench",
        "traffic",
        "--traffic",
        str(traffic),
        "--model",
        str(tiny_model_dir),
        "--requests",
        "4",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--profile",
        str(profile_path),
    ).stdout
    result = json.loads(bench.strip().splitlines()[-1])
    assert (result["requests"], result["repeats"], len(result["repeat_means_s"])) == (8, 2, 2)
    keys = ("mean_request_s", "all_mean_request_s", "median_request_s", "mean_ttft_s", "predicted_request_s")
    for key in (*keys, "predicted_over_measured"):
        assert result[key] > 0, key
    assert min(result["repeat_means_s"]) <= result["mean_request_s"] <= max(result["repeat_means_s"])
    assert sum(kind["count"] for kind in result["per_kind"]) == 8
    assert result["predicted_request_s"] == pytest.approx(plan["times"]["request_s_disaggregated"], abs=1e-5)
