"""`epd plan --plots`: the three PNGs are written, open as images of a useful size, and have labelled axes.

The labels are read back from each figure's axes before it is saved (`PlotFile`), and the files are opened once
with PIL; a missing label, legend or file fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from services import cli
from services.capacity.model_sizes import load_sizes
from services.capacity.plan import make_plan
from services.capacity.plots import draw_plots
from services.capacity.profile import save_profile
from services.capacity.traffic import parse_traffic
from tests.capacity_support import make_7b_folder, synthetic_profile

TRAFFIC = {
    "requests": [
        {"images": ["1344x1008"], "text_tokens": 100, "output_tokens": 200, "share": 0.7},
        {"text_tokens": 400, "output_tokens": 50, "share": 0.3},
    ],
    "reuse": 0.3,
    "rate": 1.5,
    "itl_ms": 50,
}
EXPECTED = {
    "times_vs_image_tokens.png": ("image tokens per request", "time (ms)", 3),
    "colocated_vs_disaggregated.png": ("requests per second per worker", "mean request time (ms)", 3),
    "request_time_vs_hit_rate.png": ("embedding cache hit rate", "mean request time (ms)", 4),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_7b_folder(tmp_path_factory.mktemp("qwen2-vl-7b-shape"))


def test_three_plots_with_labelled_axes(folder: Path, tmp_path: Path) -> None:
    plan = make_plan(load_sizes(folder), parse_traffic(TRAFFIC), synthetic_profile())
    plots = draw_plots(plan, tmp_path / "plots")
    assert sorted(p.path.name for p in plots) == sorted(EXPECTED)
    for plot in plots:
        xlabel, ylabel, legend_entries = EXPECTED[plot.path.name]
        assert (plot.xlabel, plot.ylabel) == (xlabel, ylabel)
        assert plot.title
        assert len(plot.legend) >= legend_entries and all(plot.legend)
        with Image.open(plot.path) as image:
            assert image.format == "PNG"
            assert image.width >= 600 and image.height >= 400
            assert len(image.convert("L").getcolors(maxcolors=256) or range(257)) > 10  # drawn, not blank


def test_plots_from_the_command(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traffic = tmp_path / "traffic.yaml"
    traffic.write_text(json.dumps(TRAFFIC))
    save_profile(synthetic_profile(), tmp_path / "profile.json")
    args = ["plan", "--model", str(folder), "--traffic", str(traffic), "--profile", str(tmp_path / "profile.json")]
    assert cli.main([*args, "--plots", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(Path(p).name for p in report["plots"]) == sorted(EXPECTED)
    assert all(Path(p).stat().st_size > 10_000 for p in report["plots"])
