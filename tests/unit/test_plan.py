"""`epd plan` and its parts: the worked example of docs/planning.md, traffic files, the cost model's
arithmetic, the fits, profile files, and the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services import cli
from services.capacity import cost_model as cm
from services.capacity.fit import FitError, LinearFit, fit
from services.capacity.model_sizes import load_sizes
from services.capacity.plan import make_plan, plan_json
from services.capacity.plan_table import plan_table
from services.capacity.profile import ProfileError, load_profile, save_profile
from services.capacity.traffic import Traffic, TrafficError, load_traffic, parse_traffic
from tests.capacity_support import make_7b_folder, synthetic_profile

WORKED = {"requests": [{"images": ["1344x1008"], "text_tokens": 100, "output_tokens": 200}]}


@pytest.fixture(scope="module")
def folder_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_7b_folder(tmp_path_factory.mktemp("qwen2-vl-7b-shape"))


@pytest.fixture
def no_weight_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load a checkpoint fails the test (the folder has none anyway)."""
    from transformers import PreTrainedModel

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("epd plan must not load weights")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))


def _traffic_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "traffic.yaml"
    path.write_text(text)
    return path


# ----- the worked example -----


def test_worked_example_sizes(folder_7b: Path) -> None:
    assert not [p for p in folder_7b.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    sizes = load_sizes(folder_7b)  # the config names no dtype: 16-bit (bfloat16)
    assert (sizes.num_layers, sizes.kv_heads, sizes.head_dim, sizes.hidden_size) == (28, 4, 128, 3584)
    assert sizes.dtype == "bfloat16"
    assert sizes.kv_bytes_per_token == 57_344
    image = sizes.image(1344, 1008)
    assert image.tokens_uncapped == 1_728
    assert image.tokens == 1_230
    assert (image.resized_width, image.resized_height) == (1148, 840)
    assert image.kv_bytes_uncapped == 1_728 * 57_344 == 99_090_432
    assert round(image.kv_bytes_uncapped / 2**20, 1) == 94.5
    assert round(image.kv_bytes_uncapped / 1e6) == 99
    assert image.embedding_bytes_uncapped == 1_728 * 3_584 * 2 == 12_386_304
    assert round(image.embedding_bytes_uncapped / 1e6, 1) == 12.4


def test_worked_example_through_the_command(
    folder_7b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_weight_loading: None
) -> None:
    traffic = _traffic_file(tmp_path, json.dumps(WORKED))
    assert cli.main(["plan", "--model", str(folder_7b), "--traffic", str(traffic), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_bytes_per_token"] == 57_344
    image = report["requests"][0]["images"][0]
    assert (image["tokens"], image["tokens_uncapped"]) == (1_230, 1_728)
    assert (image["kv_bytes_uncapped"], image["embedding_bytes_uncapped"]) == (99_090_432, 12_386_304)
    assert report["times"] is None and "epd profile" in report["note"]
    assert cli.main(["plan", "--model", str(folder_7b), "--traffic", str(traffic)]) == 0
    table = capsys.readouterr().out
    assert "KV per token 57,344 B" in table
    assert "1,230 tokens (1,728 uncapped)" in table
    assert "uncapped: KV 94.5 MiB (99.1 MB) vs embedding 11.8 MiB (12.4 MB)" in table


# ----- traffic files -----


def test_traffic_file_parsed_with_defaults_and_normalised_shares(tmp_path: Path) -> None:
    path = _traffic_file(
        tmp_path,
        """
requests:
  - {images: ["1344x1008", "640x480"], text_tokens: 100, output_tokens: 200, share: 3}
  - {output_tokens: 20, share: 1}
reuse: 0.25
rate: 2.5
ttft_ms: 2000
itl_ms: 50
""",
    )
    traffic = load_traffic(path)
    first, second = traffic.requests
    assert first.images == ((1344, 1008), (640, 480)) and first.share == 0.75
    assert (second.images, second.text_tokens, second.video_seconds, second.share) == ((), 0, 0.0, 0.25)
    assert (traffic.reuse, traffic.rate, traffic.concurrency, traffic.ttft_ms, traffic.itl_ms) == (
        0.25,
        2.5,
        None,
        2000.0,
        50.0,
    )
    assert traffic.clients == 0
    assert parse_traffic({"requests": [{"output_tokens": 1}]}).clients == 1  # neither: one closed-loop client


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({}, "requests: must be a non-empty list"),
        ({"requests": []}, "requests: must be a non-empty list"),
        ({"requests": [{"images": ["1344*1008"], "output_tokens": 1}]}, "requests[0].images[0]: must be a size"),
        ({"requests": [{"images": "1344x1008", "output_tokens": 1}]}, "requests[0].images: must be a list"),
        ({"requests": [{"text_tokens": 5}]}, "requests[0].output_tokens: missing"),
        ({"requests": [{"output_tokens": 0}]}, "requests[0].output_tokens: must be a whole number >= 1, got 0"),
        ({"requests": [{"output_tokens": 2.5}]}, "requests[0].output_tokens: must be a whole number >= 1"),
        ({"requests": [{"output_tokens": 1, "text_tokens": "many"}]}, "requests[0].text_tokens: must be a whole"),
        ({"requests": [{"output_tokens": 1, "share": 0}]}, "requests[0].share: must be a number above 0"),
        ({"requests": [{"output_tokens": 1, "imgs": []}]}, "requests[0].imgs: unknown field"),
        ({"requests": [{"output_tokens": 1}], "reuse": 1.5}, "reuse: must be a number >= 0 and <= 1, got 1.5"),
        ({"requests": [{"output_tokens": 1}], "rate": 0}, "rate: must be a number above 0"),
        ({"requests": [{"output_tokens": 1}], "rate": 1, "concurrency": 2}, "rate and concurrency: give one"),
        ({"requests": [{"output_tokens": 1}], "itl": 50}, "itl: unknown field"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_traffic_errors_name_the_field(document: object, message: str) -> None:
    with pytest.raises(TrafficError) as caught:
        parse_traffic(document)
    assert message in str(caught.value)


def test_traffic_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TrafficError, match=r"cannot read traffic file .*missing\.yaml"):
        load_traffic(tmp_path / "missing.yaml")
    with pytest.raises(TrafficError, match=r"traffic\.yaml is not valid YAML at line \d+"):
        load_traffic(_traffic_file(tmp_path, "requests:\n  - {images: [\n"))
    with pytest.raises(TrafficError, match=r"traffic\.yaml: reuse: must be"):
        load_traffic(_traffic_file(tmp_path, "requests: [{output_tokens: 1}]\nreuse: -1\n"))


def test_a_video_is_counted_by_the_models_own_sampling(folder_7b: Path) -> None:
    """10 s of 1280x720 at 30 fps: Qwen2-VL samples 2 frames a second (20), two frames per temporal patch (10
    groups), each group (h / 28) x (w / 28) tokens after its resize; the plan's tokens and bytes are the adapter's
    header count, and the video costs the encoder per frame and per group."""
    sizes = load_sizes(folder_7b)
    traffic = parse_traffic(
        {"requests": [{"video_seconds": 10, "video_size": "1280x720", "text_tokens": 50, "output_tokens": 100}]}
    )
    plan = make_plan(sizes, traffic, synthetic_profile())
    kind = plan.kinds[0]
    (video,) = kind.videos
    expected = sizes.adapter.video_tokens(1280, 720, 300, 30.0)
    assert (video.frames, video.temporal_groups) == (20, 10) == (len(expected.frame_indices), expected.grid_thw[0])
    assert video.resized_width % 28 == 0 and video.resized_height % 28 == 0
    assert abs(video.resized_width / video.resized_height - 16 / 9) < 0.1
    assert video.tokens == expected.num_tokens == 10 * (video.resized_height // 28) * (video.resized_width // 28)
    assert kind.prompt_tokens == 50 + video.tokens and kind.image_tokens == 0
    assert (video.kv_bytes, video.embedding_bytes) == (video.tokens * 57_344, video.tokens * 3_584 * 2)
    assert kind.label == "video 10s 1280x720 + 50 txt -> 100 out"
    profile = plan.profile
    assert profile is not None and plan.disaggregated is not None
    per_frame = profile.prepare(megapixels=1280 * 720 / 1e6)
    tower = 10 * profile.tower(tokens=video.tokens / 10)
    assert plan.disaggregated.times.per_kind[0].encode_s == pytest.approx(20 * per_frame + tower)
    report = plan_json(plan)
    assert report["requests"][0]["video_tokens"] == video.tokens
    assert report["requests"][0]["videos"][0]["frames"] == 20
    text = plan_table(report)
    assert "1280x720 10 s at 30 fps: 20 frames sampled" in text
    assert report["deployment"]["recommendation"] in ("co-located", "disaggregated")
    longer = make_plan(
        sizes,
        parse_traffic({"requests": [{"video_seconds": 20, "video_size": "1280x720", "output_tokens": 100}]}),
        synthetic_profile(),
    )
    assert longer.kinds[0].videos[0].frames == 40
    assert longer.disaggregated is not None and longer.disaggregated.times.per_kind[0].encode_s > tower


@pytest.mark.parametrize(
    ("request_kind", "message"),
    [
        ({"video_seconds": 4}, "requests[0].video_size: missing"),
        ({"video_size": "640x480"}, "requests[0].video_seconds: must be above 0 when video_size"),
        ({"video_seconds": 4, "video_size": "640"}, "requests[0].video_size: must be a size WIDTHxHEIGHT"),
        ({"video_seconds": 4, "video_size": "640x480", "video_fps": 0}, "requests[0].video_fps: must be a number"),
    ],
)
def test_video_fields_are_checked(request_kind: dict, message: str) -> None:
    with pytest.raises(TrafficError) as caught:
        parse_traffic({"requests": [{"output_tokens": 1, **request_kind}]})
    assert message in str(caught.value)


def test_a_model_without_video_refuses_it_naming_the_field(tmp_path: Path) -> None:
    from services.models.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / "llava", family="llava")
    traffic = parse_traffic({"requests": [{"output_tokens": 1, "video_seconds": 4, "video_size": "640x480"}]})
    with pytest.raises(TrafficError, match=r"requests\[0\]\.video_seconds: llava models take no video"):
        make_plan(load_sizes(folder), traffic, None)


def test_bad_traffic_is_a_one_line_usage_error(
    folder_7b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traffic = _traffic_file(tmp_path, "requests: [{output_tokens: 0}]\n")
    assert cli.main(["plan", "--model", str(folder_7b), "--traffic", str(traffic)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("epd: error: traffic file") and "output_tokens: must be a whole number >= 1" in err
    assert "\n" not in err
    good = _traffic_file(tmp_path, json.dumps(WORKED))
    assert cli.main(["plan", "--model", str(folder_7b), "--traffic", str(good), "--plots", str(tmp_path)]) == 2
    assert "--plots draws times, which need a profile" in capsys.readouterr().err


# ----- the cost model's arithmetic (synthetic profile: tests/capacity_support.py) -----


def test_request_times_by_hand(folder_7b: Path) -> None:
    sizes = load_sizes(folder_7b)
    model = cm.CostModel(sizes, synthetic_profile())
    kind = cm.kind_sizes(sizes, parse_traffic(WORKED).requests[0])
    assert (kind.image_tokens, kind.prompt_tokens, kind.embedding_bytes) == (1230, 1330, 1230 * 7168)
    t = model.times(kind, batch=1, hit_rate=0.0)
    megabytes = 1230 * 7168 / 1e6
    encode = (0.002 + 0.010 * 1344 * 1008 / 1e6) + (0.001 + 20e-6 * 1230)
    write, read, push = 0.002 * megabytes, 0.001 * megabytes, 0.001 + 0.001 * megabytes
    prefill = 50e-6 * 1330 + 1e-9 * 1330**2
    decode = 199 * (0.005 + 0.001)
    serving, first = 0.003 + 0.0005 * 200 + 0.004, 0.003 + 0.0005 + 0.004
    assert t.encode_s == pytest.approx(encode)
    assert (t.cache_write_s, t.cache_read_s, t.transfer_s) == pytest.approx((write, read, push))
    assert (t.prefill_s, t.decode_s, t.serving_s) == pytest.approx((prefill, decode, serving))
    assert t.disaggregated_s == pytest.approx(serving + encode + write + push + prefill + decode)
    assert t.colocated_s == pytest.approx(serving + encode + write + prefill + decode)  # B = 1: nothing stretched
    assert t.ttft_s == pytest.approx(first + encode + write + push + prefill)
    assert t.itl_s == pytest.approx(0.006 + 0.0005)
    half = model.times(kind, batch=1, hit_rate=0.5)
    expected = serving + 0.5 * (encode + write + push) + 0.5 * read + prefill + decode
    assert half.disaggregated_s == pytest.approx(expected)
    stretched = model.times(kind, batch=4, hit_rate=0.0, encode_load=0.2)
    assert stretched.colocated_s - stretched.serving_s - encode - write - prefill == pytest.approx(
        199 * (0.005 + 0.004) / (1 - 0.2 * (1 - 1 / 4))
    )
    mix = cm.mix_times(model, [kind], 1, 0.0, 0.0)
    assert cm.cache_break_even(mix) == pytest.approx(write / (encode + write + push - read))
    assert cm.no_cache_s(mix) == pytest.approx(serving + encode + push + prefill + decode)


def test_loads_by_hand(folder_7b: Path) -> None:
    sizes = load_sizes(folder_7b)
    model = cm.CostModel(sizes, synthetic_profile())
    kinds = [cm.kind_sizes(sizes, parse_traffic(WORKED).requests[0])]
    single = cm.solve_load(model, kinds, Traffic(parse_traffic(WORKED).requests, concurrency=1), "disaggregated")
    assert (single.batch, single.workers, single.encoders, single.stable) == (1.0, 1, 1, True)
    assert single.rate == pytest.approx(1 / single.request_s)
    # 8 clients, ITL within 10 ms: step 5 ms + 1 ms/sequence + 0.5 ms serving -> at most 4 sequences per worker
    requests = parse_traffic(WORKED).requests
    eight = cm.solve_load(model, kinds, Traffic(requests, concurrency=8, itl_ms=10), "disaggregated")
    assert (eight.workers, eight.batch) == (2, 4.0)
    assert eight.times.mean("itl_s") == pytest.approx(0.005 + 0.004 + 0.0005)
    # an open-loop rate: Little's law, and a worker at most 80 % busy
    rate = cm.solve_load(model, kinds, Traffic(parse_traffic(WORKED).requests, rate=2.0), "disaggregated")
    busy = rate.times.mean("prefill_s") + rate.times.mean("decode_s") / rate.batch
    assert rate.in_system == pytest.approx(2.0 * rate.request_s)
    assert rate.workers == math.ceil(2.0 * busy / cm.UTILISATION)
    assert rate.batch == pytest.approx(max(1.0, rate.in_system / rate.workers))
    assert rate.encoders == math.ceil(2.0 * rate.times.mean("encoder_busy_s") / cm.UTILISATION)


def test_plan_report_with_a_profile(folder_7b: Path) -> None:
    traffic = parse_traffic({**WORKED, "concurrency": 1, "itl_ms": 100, "reuse": 0.5})
    plan = make_plan(load_sizes(folder_7b), traffic, synthetic_profile())
    report = plan_json(plan)
    deployment, cache = report["deployment"], report["cache"]
    # the co-located worst gap (6.5 ms step + 41 ms encode + 18 ms cache write) is within 100 ms, and co-located is
    # faster (no transfer; one client, so no other sequence's decode is stretched)
    assert deployment["recommendation"] == "co-located"
    assert deployment["kv_bytes_per_worker"] == pytest.approx(1 * 1530 * 57_344)
    times = report["requests"][0]["times"]
    busy = times["prefill_s"] + times["decode_s"]
    encoder_busy = 0.5 * (times["encode_s"] + times["cache_write_s"])
    assert deployment["encoder_worker_ratio"] == pytest.approx(encoder_busy / busy)
    assert cache["pays"] is True and 0 < cache["break_even_hit_rate"] < 0.5
    assert "warnings" not in report  # the profile is of this model's shape
    strict = make_plan(load_sizes(folder_7b), parse_traffic({**WORKED, "itl_ms": 10}), synthetic_profile())
    mode, reasons = strict.recommendation
    assert mode == "disaggregated" and "over the 10 ms inter-token target" in reasons[0]
    table = plan_table(plan_json(strict))
    assert "deployment: disaggregated" in table and "target itl_ms: 10" in table
    other = synthetic_profile()
    other.model["hidden_size"] = 64
    foreign = plan_table(plan_json(make_plan(load_sizes(folder_7b), traffic, other)))
    assert "WARNING: the profile was measured on a qwen2_vl model of hidden size 64" in foreign


# ----- fits -----


def test_fit_recovers_known_curves() -> None:
    points = [{"tokens": t, "seconds": 0.002 + 3e-6 * t + 4e-9 * t * t} for t in (64, 256, 1024, 4096)]
    for relative in (False, True):
        curve = fit(points, "seconds", ("1", "tokens", "tokens*tokens"), relative=relative)
        assert curve.coefficients == pytest.approx((0.002, 3e-6, 4e-9), rel=1e-6)
        assert curve(tokens=2048) == pytest.approx(0.002 + 3e-6 * 2048 + 4e-9 * 2048**2)
    sizes = [(b, c) for b in (1, 4, 16) for c in (64, 512)]
    plane = [{"batch": b, "context": c, "step_s": 0.001 + 2e-5 * b + 3e-8 * b * c} for b, c in sizes]
    assert fit(plane, "step_s", ("1", "batch", "batch*context")).coefficients == pytest.approx((0.001, 2e-5, 3e-8))


def test_fit_drops_a_negative_term_and_refits() -> None:
    points = [{"x": x, "y": 3 * x - 0.5} for x in (1, 2, 3, 4)]  # unconstrained: constant -0.5
    curve = fit(points, "y", ("1", "x"))
    assert curve.coefficient("1") == 0.0
    assert curve.coefficient("x") == pytest.approx(sum(3 * x * x - 0.5 * x for x in (1, 2, 3, 4)) / 30)
    assert all(c >= 0 for c in curve.coefficients)


def test_fit_refuses_what_it_cannot_determine() -> None:
    with pytest.raises(FitError, match="do not determine"):
        fit([{"x": 1, "y": 1}, {"x": 1, "y": 2}], "y", ("1", "x"))
    with pytest.raises(FitError, match="lacks 'x'"):
        fit([{"y": 1}], "y", ("x",))
    with pytest.raises(FitError, match="above 0"):
        fit([{"x": 1, "y": 0}, {"x": 2, "y": 1}], "y", ("x",), relative=True)


# ----- profile files -----


def test_profile_file_round_trip_and_errors(tmp_path: Path) -> None:
    profile = synthetic_profile()
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["megabytes_per_s"]["grpc"] == pytest.approx(1000.0)
    data["schema"] = "something-else"
    (tmp_path / "q.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"q\.json: not an epd profile"):
        load_profile(tmp_path / "q.json")
    del data["fits"]["decode"]
    data["schema"] = "epd-profile-v1"
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="lacks 'decode'"):
        load_profile(tmp_path / "r.json")
    (tmp_path / "s.json").write_text("{")
    with pytest.raises(ProfileError, match="is not JSON"):
        load_profile(tmp_path / "s.json")
    assert LinearFit.from_json(profile.decode.to_json()) == profile.decode


def test_profile_refuses_sizes_that_cannot_fit_a_curve(folder_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["profile", "--model", str(folder_7b), "--image-sides", "100,200", "--transfer-mb", "1"]
    assert cli.main(args) == 2  # refused before anything is loaded or started
    err = capsys.readouterr().err
    assert "2 image sides cannot fit a curve: give at least 3" in err
    assert "1 transfer sizes cannot fit a curve: give at least 2" in err


def test_serving_fit_in_two_stages_on_synthetic_probes() -> None:
    from services.capacity.measure_cluster import fit_serving, probe_quartiles

    def point(probe: str, out: int, images: int, tokens: int, noise: float = 0.0) -> dict[str, object]:
        residual = 0.004 + 0.0006 * out + 0.003 * images + 5e-5 * tokens + noise
        return {"probe": probe, "output_tokens": out, "images": images, "image_tokens": tokens, "residual_s": residual}

    shapes = [("t", 1, 0, 0), ("t48", 48, 0, 0), ("t96", 96, 0, 0)]
    shapes += [("i", 1, 1, 234), ("I", 1, 1, 972), ("ii", 1, 2, 468)]
    points = [point(*shape) for shape in shapes for _ in range(3)]
    points += [point("i", 1, 1, 234, noise=1.0)] * 2  # slow requests: the probe's lower quartile ignores them
    medians = probe_quartiles(points)
    assert len(medians) == len(shapes) and all("probe" not in p for p in medians)
    curve = fit_serving(medians)
    assert curve.coefficients == pytest.approx((0.004, 0.0006, 0.003, 5e-5), rel=1e-6)
    capped = fit_serving([p for p in medians if p["image_tokens"] in (0, 234)] + [point("I", 1, 1, 234)])
    assert capped.coefficient("images") == 0.0  # one image size only: the per-image term cannot be told apart
    assert capped(output_tokens=1, images=1, image_tokens=234) == pytest.approx(0.004 + 0.0006 + 0.003 + 5e-5 * 234)
