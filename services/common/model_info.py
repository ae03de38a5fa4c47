"""What every service knows about the served model: its adapter and its hashing identity."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.hashing import ModelIdentity
from services.models.base import ModelAdapter
from services.models.registry import load_adapter, model_revision


@dataclass(frozen=True)
class ModelInfo:
    """The adapter (config, tokenizer, processor settings; no weights) and the identity for hashes.

    Router, encoder and worker build this from the same folder, so they agree on `mm_hash`
    and on cache keys (`identity.revision`).
    """

    model_dir: Path
    adapter: ModelAdapter
    identity: ModelIdentity


def load_model_info(model_dir: str | Path) -> ModelInfo:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
    adapter = load_adapter(path)
    identity = ModelIdentity(
        model_id=adapter.model_type,
        revision=model_revision(path),
        processor_settings=adapter.processor_settings(),
    )
    return ModelInfo(path, adapter, identity)
