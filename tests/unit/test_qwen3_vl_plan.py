"""`epd plan` on a config-only Qwen3-VL-8B-shaped folder: tokens per 1344x1008 image by Qwen3-VL's processor rule,
and embedding bytes per image that count the three DeepStack levels travelling with each row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from services.capacity.model_sizes import load_sizes

WORKED = {"requests": [{"images": ["1344x1008"], "text_tokens": 100, "output_tokens": 200}]}


@pytest.fixture(scope="module")
def folder_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL-8B's config (services/models/shapes.py), a tokenizer with Qwen3-VL's template and the released image
    processor settings (16-pixel patches, 65536..16777216 pixels, mean and std 0.5); no weights."""
    from transformers import Qwen2VLImageProcessor

    from services.models.shapes import qwen3_vl_8b_config
    from services.models.tiny_qwen3_vl import QWEN3_VL_CHAT_TEMPLATE
    from services.models.tiny_tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("qwen3-vl-8b-shape")
    qwen3_vl_8b_config().save_pretrained(path)
    save_tokenizer(path, 1024, 262144, QWEN3_VL_CHAT_TEMPLATE)
    Qwen2VLImageProcessor(
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(path)
    return path


def test_sizes_count_the_deepstack_levels(folder_8b: Path) -> None:
    assert not [p for p in folder_8b.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    sizes = load_sizes(folder_8b, "bfloat16")
    assert (sizes.num_layers, sizes.kv_heads, sizes.head_dim, sizes.hidden_size) == (36, 8, 128, 4096)
    assert sizes.embedding_width == 4 * 4096  # main + 3 DeepStack levels
    assert sizes.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    assert sizes.embedding_bytes_per_token == 4 * 4096 * 2 == 32_768
    image = sizes.image(1344, 1008)
    # 32 pixels per token side: 1008 / 32 = 31.5 rounds (half to even) to 32, so 1024 x 1344, 32 x 42 tokens
    assert (image.resized_width, image.resized_height, image.tokens) == (1344, 1024, 1344)
    assert image.embedding_bytes == 1344 * 32_768 == 44_040_192
    assert image.kv_bytes == 1344 * 147_456


def test_plan_prints_tokens_and_embedding_bytes(
    folder_8b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traffic = tmp_path / "traffic.json"
    traffic.write_text(json.dumps(WORKED))
    assert (
        cli.main(["plan", "--model", str(folder_8b), "--traffic", str(traffic), "--json", "--dtype", "bfloat16"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["model_type"] == "qwen3_vl" and report["model"]["embedding_width"] == 16_384
    image = report["requests"][0]["images"][0]
    assert (image["tokens"], image["embedding_bytes"]) == (1344, 44_040_192)
    assert cli.main(["plan", "--model", str(folder_8b), "--traffic", str(traffic), "--dtype", "bfloat16"]) == 0
    table = capsys.readouterr().out
    assert "embedding per image token 32,768 B (4 x hidden: main + 3 DeepStack levels)" in table
    assert "1,344 tokens" in table and "embedding 42.0 MiB (44.0 MB)" in table
