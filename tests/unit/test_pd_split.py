"""`epd plan`'s prefill/decode split (services/capacity/pd_split.py) on the config-only Qwen2-VL-7B-shaped folder
and the synthetic profile of tests/capacity_support.py: a short text kind is always prefilled where it decodes; a
two-image kind whose prefill holds decoding past the inter-token target goes to a prefill pool only where shipping
its KV costs less than computing it (gloo at 2 GB/s: yes; gRPC at 1 GB/s: no), with its prompt as the threshold and
the pools' ratio; the report and the table say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from services.capacity.model_sizes import load_sizes
from services.capacity.plan import make_plan, plan_json
from services.capacity.plan_table import plan_table
from services.capacity.profile import save_profile
from services.capacity.traffic import parse_traffic
from tests.capacity_support import make_7b_folder, synthetic_profile

TRAFFIC = {
    "requests": [
        {"text_tokens": 40, "output_tokens": 100, "share": 0.5},
        {"images": ["1344x1008", "1344x1008"], "text_tokens": 100, "output_tokens": 200, "share": 0.5},
    ],
    "concurrency": 8,
    "itl_ms": 40,
}


@pytest.fixture(scope="module")
def folder_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_7b_folder(tmp_path_factory.mktemp("qwen2-vl-7b-shape"))


def _split(folder: Path, transport: str, traffic: dict = TRAFFIC) -> dict:
    return plan_json(make_plan(load_sizes(folder), parse_traffic(traffic), synthetic_profile(), transport))


def test_a_long_prefill_goes_to_the_pool_where_shipping_costs_less(folder_7b: Path) -> None:
    report = _split(folder_7b, "gloo")
    split = report["prefill_decode"]
    chat, images = split["kinds"]
    prompt = report["requests"][1]["prompt_tokens"]
    assert images["prompt_tokens"] == prompt and prompt > 2 * 1230
    assert images["prefill_s"] == pytest.approx(50e-6 * prompt + 1e-9 * prompt**2)  # the profile's prefill curve
    assert images["kv_transfer_s"] == pytest.approx(0.0005 * prompt * 57_344 / 1e6)  # gloo: 0.5 ms/MB of KV
    assert images["remote"] and images["kv_transfer_s"] < images["prefill_s"] > images["allowed_stall_s"]
    assert not chat["remote"] and chat["prefill_s"] < chat["allowed_stall_s"]
    assert split["recommendation"] == "prefill pool" and split["threshold_tokens"] == prompt
    assert split["ttft_cost_s"] == pytest.approx(images["kv_transfer_s"])
    ratio = split["ratio"]
    assert ratio["decode"] == 1.0 and ratio["prefill"] > 0 and ratio["encoder"] > 0
    assert report["requests"][1]["label"] in split["reasons"][0] and "40 ms inter-token target" in split["reasons"][0]
    assert "note" not in split  # KV goes over gloo (EPD_KV_TRANSPORT=dist)
    table = plan_table(report)
    assert "prefill/decode: prefill pool" in table and f"EPD_PD_MIN_PREFILL_TOKENS={prompt}" in table


def test_shipping_that_costs_more_than_the_prefill_keeps_it_local(folder_7b: Path) -> None:
    split = _split(folder_7b, "grpc")["prefill_decode"]
    images = split["kinds"][1]
    assert images["kv_transfer_s"] > images["prefill_s"] > images["allowed_stall_s"]  # 1 ms/MB: 150 MB of KV
    assert split["recommendation"] == "co-located prefill" and split["threshold_tokens"] is None
    assert split["ratio"]["prefill"] == 0.0 and not any(k["remote"] for k in split["kinds"]) and "note" not in split


def test_without_a_target_the_stall_is_weighed_in_inter_token_gaps(folder_7b: Path) -> None:
    traffic = {key: value for key, value in TRAFFIC.items() if key != "itl_ms"}
    split = _split(folder_7b, "gloo", traffic)["prefill_decode"]
    images = split["kinds"][1]
    assert images["remote"] and "4 inter-token gaps" in split["reasons"][0]


def test_epd_plan_prints_it(folder_7b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_profile(synthetic_profile(), tmp_path / "profile.json")
    (tmp_path / "traffic.json").write_text(json.dumps(TRAFFIC))
    argv = ["plan", "--model", str(folder_7b), "--traffic", str(tmp_path / "traffic.json")]
    argv += ["--profile", str(tmp_path / "profile.json"), "--transport", "gloo"]
    assert cli.main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prefill/decode:"))
    assert "prefill pool" in line and "EPD_PD_MIN_PREFILL_TOKENS=" in line and "encoder : prefill : decode" in line


def test_no_profile_no_split(folder_7b: Path) -> None:
    report = plan_json(make_plan(load_sizes(folder_7b), parse_traffic(TRAFFIC), None))
    assert report["prefill_decode"] is None
