"""Choosing a model adapter for a folder, and naming the folder's weights.

`load_adapter` maps the folder's `config.model_type` to an adapter class through one dict: adding a
family means adding its adapter module and one entry here, nothing anywhere else. The dict names each class by
module and attribute, imported only when a folder of that family is loaded: reading which families exist (the
launcher's checks) imports no torch or transformers.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from services.models.loading import read_model_type

if TYPE_CHECKING:
    from services.models.base import ModelAdapter

ADAPTERS: dict[str, str] = {
    "qwen2_vl": "services.models.qwen2_vl:Qwen2VLAdapter",
    "qwen2_5_vl": "services.models.qwen2_vl:Qwen2VLAdapter",
    "qwen3_vl": "services.models.qwen3_vl:Qwen3VLAdapter",
    "llava": "services.models.llava:LlavaAdapter",
}
"""model_type -> the adapter class, as ``module:attribute``."""

_EDGE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_REVISION_SCHEME = b"epd-model-revision-v1"


def load_adapter(model_dir: Path) -> ModelAdapter:
    """The adapter for the folder's `config.model_type` (config, tokenizer, processor; no weights).

    Raises ValueError naming the type when no adapter handles it.
    """
    model_type = read_model_type(Path(model_dir))
    return adapter_class(model_type).from_folder(Path(model_dir))


def adapter_class(model_type: str) -> type[ModelAdapter]:
    """The adapter class serving ``model_type`` (its module imported now); ValueError naming the type if none."""
    name = ADAPTERS.get(model_type)
    if name is None:
        known = ", ".join(sorted(ADAPTERS))
        raise ValueError(f"no adapter for model_type {model_type!r} (supported: {known})")
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


def model_revision(model_dir: Path) -> str:
    """A stable hex id (sha256) of the folder's model, cheap enough to compute at every start.

    Hashed, length-prefixed: a scheme tag, the bytes of config.json, then for each weight file
    (`*.safetensors`, `*.bin`, `*.pt`, `*.pth` at the folder's top level, sorted by name) its name,
    its size and its first and last 1 MiB. Whole files are never read: multi-GB checkpoints would make
    every start slow, and safetensors files open with their header (which names every tensor, dtype,
    shape and offset) while random weights differ in their final bytes, so a changed checkpoint
    changes the id in practice. A change that keeps size, header and both ends identical (an edit in
    the middle of a large tensor) is deliberately not detected. Tokenizer and processor files are not
    part of the revision: they change prompts and pixels, which the media hash and prompt path cover.
    """
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model folder: config.json is missing")
    digest = hashlib.sha256()
    _field(digest, _REVISION_SCHEME)
    _field(digest, config.read_bytes())
    weights = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        raise FileNotFoundError(f"{model_dir} holds no weight files")
    for path in weights:
        size = path.stat().st_size
        _field(digest, path.name.encode("utf-8"))
        _field(digest, str(size).encode("ascii"))
        with path.open("rb") as handle:
            _field(digest, handle.read(_EDGE_BYTES))
            handle.seek(max(0, size - _EDGE_BYTES))
            _field(digest, handle.read(_EDGE_BYTES))
    return digest.hexdigest()


def _field(digest: hashlib._Hash, data: bytes) -> None:
    digest.update(len(data).to_bytes(8, "big"))
    digest.update(data)
