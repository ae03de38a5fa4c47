"""`epd plan --device-memory-gb`: a model's weights and KV per tensor-parallel rank from its config (a weightless
model on torch's ``meta`` device, cut as the worker cuts it), and the smallest size at which it fits a device with
a KV budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class RankFit:
    """One tensor-parallel size on one device: rank 0's bytes (the largest rank: the vision tower, the longer
    slices), whether they fit ``usable_bytes``, and how many tokens of KV the rest would hold. ``refused`` says
    why a size cannot split the model (the other fields are then 0)."""

    size: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int
    usable_bytes: int
    kv_tokens_that_fit: int
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.refused is None and self.weights_bytes + self.kv_bytes <= self.usable_bytes


def weightless_model(config: Any) -> Any:
    """The transformers model of ``config`` on the ``meta`` device: shapes, no memory."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def rank_fits(
    model: Any, dtype_bytes: int, device_gb: float, kv_tokens: int, utilization: float = 0.9
) -> list[RankFit]:
    """Each of `SIZES` on a device of ``device_gb`` GiB of which ``utilization`` is for weights and KV (the
    worker's `EPD_GPU_MEMORY_UTILIZATION`), holding ``kv_tokens`` tokens of KV (each rank its own heads')."""
    from services.worker.engine.tensor_parallel.layers import rank_parameters
    from services.worker.engine.tensor_parallel.plan import ShardPlan

    text = model.config.get_text_config()
    usable = int(device_gb * GIB * utilization)
    fits = []
    for size in SIZES:
        try:
            plan = ShardPlan.of_config(model.config, size)
        except ValueError as exc:
            fits.append(RankFit(size, 0, 0, 0, usable, 0, str(exc)))
            continue
        weights = rank_parameters(model, plan, 0) * dtype_bytes
        per_token = 2 * int(text.num_hidden_layers) * plan.max_kv_heads * plan.head_dim * dtype_bytes
        room = max(usable - weights, 0) // per_token
        fits.append(RankFit(size, weights, per_token, kv_tokens * per_token, usable, room))
    return fits


def smallest_fit(fits: list[RankFit]) -> RankFit | None:
    return next((fit for fit in fits if fit.fits), None)


def fits_json(device_gb: float, kv_tokens: int, fits: list[RankFit]) -> dict[str, Any]:
    """One device size's rows for the plan's JSON (GiB figures rounded to 0.1)."""
    best = smallest_fit(fits)
    return {
        "device_memory_gb": device_gb,
        "kv_tokens": kv_tokens,
        "smallest_tensor_parallel_size": best.size if best else None,
        "sizes": [
            {
                "tensor_parallel_size": f.size,
                "weights_gib_per_rank": round(f.weights_bytes / GIB, 1),
                "kv_bytes_per_token_per_rank": f.kv_bytes_per_token,
                "kv_gib_per_rank": round(f.kv_bytes / GIB, 1),
                "usable_gib": round(f.usable_bytes / GIB, 1),
                "kv_tokens_that_fit": f.kv_tokens_that_fit,
                "fits": f.fits,
                **({"refused": f.refused} if f.refused else {}),
            }
            for f in fits
        ],
    }


def fits_table(report: dict[str, Any]) -> list[str]:
    """The tensor-parallel rows of ``fits_json`` as aligned text lines."""
    lines = [
        f"tensor parallelism on {report['device_memory_gb']:g} GB devices with {report['kv_tokens']} tokens of KV "
        f"per worker: smallest size {report['smallest_tensor_parallel_size'] or 'none (does not fit at 8)'}",
        f"  {'TP':>3} {'weights/rank':>13} {'KV/rank':>9} {'usable':>9} {'KV tokens that fit':>19}  fits",
    ]
    for row in report["sizes"]:
        if "refused" in row:
            lines.append(f"  {row['tensor_parallel_size']:>3} refused: {row['refused']}")
            continue
        lines.append(
            f"  {row['tensor_parallel_size']:>3} {row['weights_gib_per_rank']:>9.1f} GiB"
            f" {row['kv_gib_per_rank']:>5.1f} GiB {row['usable_gib']:>5.1f} GiB"
            f" {row['kv_tokens_that_fit']:>19}  {'yes' if row['fits'] else 'no'}"
        )
    return lines
