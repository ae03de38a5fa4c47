"""Test helpers for capacity planning: a weightless Qwen2-VL-7B-shaped folder and a profile with round numbers."""

from __future__ import annotations

from pathlib import Path

from services.capacity import profile as prof
from services.capacity.fit import LinearFit

MAX_PIXELS_7B = 1280 * 28 * 28


def make_7b_folder(path: Path) -> Path:
    """Qwen2-VL-7B's config (services/models/shapes.py), a tokenizer and a processor (max_pixels 1280x28x28), no
    weights: what `epd plan` needs and nothing more."""
    from transformers import Qwen2VLImageProcessor

    from services.models.shapes import qwen2_vl_7b_config
    from services.models.tiny_tokenizer import save_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    qwen2_vl_7b_config().save_pretrained(path)
    save_tokenizer(path, 1024, 32768)
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": MAX_PIXELS_7B}).save_pretrained(path)
    return path


def synthetic_profile(dtype: str = "bfloat16") -> prof.Profile:
    """A profile with round coefficients, so expected times can be worked out by hand:

    prepare = 2 ms + 10 ms/MP; tower = 1 ms + 20 us/token; prefill = 50 us/token + 1 ns/token^2; decode step =
    5 ms + 1 ms/sequence; grpc = 1 ms + 1 ms/MB; gloo = 0.5 ms/MB; redis put = 2 ms/MB; redis get = 1 ms/MB;
    serving = 3 ms + 0.5 ms/output token + 4 ms/image.
    """

    def curve(terms: tuple[str, ...], *coefficients: float) -> LinearFit:
        return LinearFit(terms, coefficients)

    return prof.Profile(
        model={"model_type": "qwen2_vl", "hidden_size": 3584},
        hardware={"device": "synthetic"},
        dtype=dtype,
        prepare=curve(prof.PREPARE_TERMS, 0.002, 0.010),
        tower=curve(prof.TOWER_TERMS, 0.001, 20e-6, 0.0),
        prefill=curve(prof.PREFILL_TERMS, 0.0, 50e-6, 1e-9),
        decode=curve(prof.DECODE_TERMS, 0.005, 0.001, 0.0),
        transports={
            "grpc": curve(prof.TRANSPORT_TERMS, 0.001, 0.001),
            "gloo": curve(prof.TRANSPORT_TERMS, 0.0, 0.0005),
            "redis_put": curve(prof.TRANSPORT_TERMS, 0.0, 0.002),
            "redis_get": curve(prof.TRANSPORT_TERMS, 0.0, 0.001),
        },
        serving=curve(prof.SERVING_TERMS, 0.003, 0.0005, 0.004, 0.0),
    )
