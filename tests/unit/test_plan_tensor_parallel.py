"""`epd plan --device-memory-gb` on a config-only Qwen2.5-VL-72B-shaped folder: weights and KV per tensor-parallel
rank from the config (a weightless model cut as the worker cuts it), and the smallest size that fits 80 GB and
141 GB devices with 131072 tokens of KV."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services import cli
from services.capacity.tp_fit import rank_fits, smallest_fit, weightless_model

TRAFFIC = {"requests": [{"images": ["1344x1008"], "text_tokens": 100, "output_tokens": 200}]}


@pytest.fixture(scope="module")
def folder_72b(tiny_model_dir_25: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-VL-72B's config (services/models/shapes.py) with the tiny Qwen2.5-VL's tokenizer and processor
    (the same 14-pixel patches and 2x2 merge); no weights."""
    from services.models.shapes import qwen2_5_vl_72b_config

    path = tmp_path_factory.mktemp("qwen2.5-vl-72b-shape")
    for name in tiny_model_dir_25.iterdir():
        if name.suffix != ".safetensors" and name.name != "config.json":
            shutil.copy(name, path / name.name)
    qwen2_5_vl_72b_config().save_pretrained(path)
    return path


def test_weights_and_kv_per_rank(folder_72b: Path) -> None:
    from transformers import AutoConfig

    model = weightless_model(AutoConfig.from_pretrained(folder_72b))
    fits = {f.size: f for f in rank_fits(model, 2, 80, 131072)}
    total = sum(p.numel() for p in model.parameters())
    assert 73e9 < total < 74e9  # Qwen2.5-VL-72B-Instruct's 73.4 B parameters
    assert fits[1].weights_bytes == 2 * total
    vision = sum(p.numel() for p in model.model.visual.parameters())
    for size in (2, 4, 8):  # the language model splits; the vision tower and the norms stay whole
        assert fits[size].weights_bytes < 2 * ((total - vision) / size + vision) * 1.01
    assert [fits[s].kv_bytes_per_token for s in (1, 2, 4, 8)] == [2 * 80 * h * 128 * 2 for h in (8, 4, 2, 1)]
    assert smallest_fit(list(fits.values())).size == 4
    assert smallest_fit(rank_fits(model, 2, 141, 131072)).size == 2


def test_plan_prints_the_tensor_parallel_size_a_72b_model_needs(
    folder_72b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traffic = tmp_path / "traffic.json"
    traffic.write_text(json.dumps(TRAFFIC))
    args = ["plan", "--model", str(folder_72b), "--traffic", str(traffic), "--dtype", "bfloat16"]
    assert cli.main([*args, "--device-memory-gb", "80,141"]) == 0
    table = capsys.readouterr().out
    assert "tensor parallelism on 80 GB devices with 131072 tokens of KV per worker: smallest size 4" in table
    assert "tensor parallelism on 141 GB devices with 131072 tokens of KV per worker: smallest size 2" in table
    assert cli.main([*args, "--device-memory-gb", "80,141", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert [d["smallest_tensor_parallel_size"] for d in report] == [4, 2]
    assert [row["fits"] for row in report[0]["sizes"]] == [False, False, True, True]
