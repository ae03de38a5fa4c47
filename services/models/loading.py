"""Reading the non-weight parts of a Hugging Face model folder (config, tokenizer, processor, eos ids).

Everything is read from the local folder only (`local_files_only=True`): a folder that lacks a file
fails here with the loader's error instead of reaching for a model hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FolderParts:
    """The parts of a model folder an adapter needs before (or without) loading weights."""

    model_dir: Path
    config: Any
    tokenizer: Any
    image_processor: Any
    eos_token_ids: list[int]


def read_model_type(model_dir: Path) -> str:
    """`model_type` from the folder's config.json (cheap: no transformers import)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model folder: config.json is missing")
    config = json.loads(path.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{path} has no model_type")
    return model_type


DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes the services compute in (`EPD_DTYPE`), and those a folder's declaration is taken from."""


def read_folder_dtype(model_dir: Path) -> str:
    """The dtype the folder's config.json declares (``dtype``, or the older ``torch_dtype``; the top level first,
    then ``text_config``), as transformers loads it by default; ``float32`` when it declares none of
    `DTYPES` or the folder has no config.json (whose absence is reported where the folder is loaded)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "float32"
    for section in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key) if isinstance(section, dict) else None
            if value in DTYPES:
                return value
    return "float32"


def load_folder_parts(model_dir: Path) -> FolderParts:
    """Load config, tokenizer and image processor from `model_dir` (the processor with its pixel table where the probe
    allows: services/models/pixel_table.py), and collect its eos token ids.

    Eos ids come from generation_config.json when present (the list `generate` stops on), else from
    the text config; duplicates are dropped, order kept.
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, GenerationConfig

    from services.models.pixel_table import install_pixel_table  # PIL: not for readers of the settings alone

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    install_pixel_table(image_processor)  # rescale and normalise as one lookup where it gives the same bits
    eos: Any = None
    if (model_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    if eos is None:
        eos = config.get_text_config().eos_token_id
    return FolderParts(
        model_dir=model_dir,
        config=config,
        tokenizer=tokenizer,
        image_processor=image_processor,
        eos_token_ids=_id_list(eos),
    )


def read_video_processor_dict(model_dir: Path) -> dict[str, Any]:
    """The folder's saved video processor settings, found as transformers' video processors find them:
    processor_config.json's "video_processor", else video_preprocessor_config.json, else the image
    processor's preprocessor_config.json (older folders have only that); {} when none exists."""
    model_dir = Path(model_dir)
    nested = model_dir / "processor_config.json"
    if nested.is_file():
        found = json.loads(nested.read_text(encoding="utf-8")).get("video_processor")
        if isinstance(found, dict):
            return found
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    return {}


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    values = [value] if isinstance(value, int) else list(value)
    return list(dict.fromkeys(int(v) for v in values))
