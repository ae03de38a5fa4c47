"""Helpers for tensor-parallel tests: tiny model folders of other head counts, and an engine's logits recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch


def tiny_variant(base: Path, out: Path, seed: int = 1, **text: Any) -> Path:
    """A copy of the tiny Qwen2-VL folder ``base`` whose language model has the ``text`` config fields (a new
    width reaches the vision tower's output too), with fresh seeded random weights."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    shutil.copytree(base, out)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["text_config"].update(text)
    if "hidden_size" in text:
        config["vision_config"]["hidden_size"] = text["hidden_size"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def record_logits(engine: Any) -> list[torch.Tensor]:
    """Every step's sampled logits of ``engine`` from now on, in order (a copy each)."""
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recorded(chunks: Any, embeddings: Any) -> Any:
        out = run(chunks, embeddings)
        seen.append(out.logits.detach().clone())
        return out

    engine.runner.run = recorded
    return seen
