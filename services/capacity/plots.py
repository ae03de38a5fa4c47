"""`epd plan --plots DIR`: the cost model's three pictures as PNG files (matplotlib figures drawn by Agg, no pyplot).

1. `times_vs_image_tokens.png`: encoder (encode, cache write, transfer), prefill and decode seconds of a request
   with the mix's mean text and output tokens, against the image tokens it carries (the adapter's resize rule,
   uncapped where the adapter has that rule, so the sweep can pass the pixel cap).
2. `colocated_vs_disaggregated.png`: the mix's mean request time on one worker against its request rate, the
   tower co-located against an encoder pool; the traffic's per-worker rate marked.
3. `request_time_vs_hit_rate.png`: the mix's mean request time against the embedding-cache hit rate, against
   no cache at all; the break-even hit rate and the traffic's `reuse` marked.

Each `PlotFile` carries the title and axis labels read back from the figure's axes before it is saved, so a
caller (and the test) can check them without parsing pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.capacity import cost_model as cm
from services.capacity.model_sizes import ImageSize
from services.capacity.plan import Plan

FIGSIZE = (7.5, 4.5)
DPI = 100


@dataclass(frozen=True)
class PlotFile:
    """A written PNG and what its axes say (read from the figure, not from the code that set them)."""

    path: Path
    title: str
    xlabel: str
    ylabel: str
    legend: tuple[str, ...]


def draw_plots(plan: Plan, out_dir: Path) -> list[PlotFile]:
    """Write the three PNGs into `out_dir` (made if missing). Raises ValueError for a plan without a profile."""
    if plan.profile is None or plan.disaggregated is None:
        raise ValueError("the plots show times: the plan needs a profile")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = cm.CostModel(plan.sizes, plan.profile, plan.transport)
    return [
        _times_vs_tokens(plan, model, out_dir / "times_vs_image_tokens.png"),
        _colocated_vs_disaggregated(plan, model, out_dir / "colocated_vs_disaggregated.png"),
        _hit_rate(plan, model, out_dir / "request_time_vs_hit_rate.png"),
    ]


def _times_vs_tokens(plan: Plan, model: cm.CostModel, path: Path) -> PlotFile:
    text = round(sum(k.share * k.text_tokens for k in plan.kinds))
    output = max(1, round(sum(k.share * k.output_tokens for k in plan.kinds)))
    batch = plan.disaggregated.batch if plan.disaggregated else 1.0
    images = [i for k in plan.kinds for i in k.images]
    ratio = images[0].height / images[0].width if images else 0.75
    largest = max([i.tokens_uncapped or i.tokens for i in images] + [1024])
    sweep = _image_sweep(plan, ratio, 2 * largest)
    xs, encoder, prefill, decode = [], [], [], []
    for image in sweep:
        kind = cm.KindSizes("sweep", 1.0, (image,), text, output)
        t = model.times(kind, batch, hit_rate=0.0)
        xs.append(image.tokens)
        encoder.append(1000 * (t.encode_s + t.cache_write_s + t.transfer_s))
        prefill.append(1000 * t.prefill_s)
        decode.append(1000 * t.decode_s)
    fig, ax = _figure()
    ax.plot(xs, encoder, label="encoder (encode + cache write + transfer)")
    ax.plot(xs, prefill, label=f"prefill ({text} text tokens + image)")
    ax.plot(xs, decode, label=f"decode ({output} tokens at batch {batch:.1f})")
    ax.set_xlabel("image tokens per request")
    ax.set_ylabel("time (ms)")
    ax.set_title("Encoder, prefill and decode time against image tokens")
    return _save(fig, ax, path)


def _image_sweep(plan: Plan, ratio: float, max_tokens: int) -> list[ImageSize]:
    """Images of one aspect ratio from small to about `max_tokens` tokens, counted by the adapter (uncapped when it
    can), each with its source size (the prepare curve reads megapixels)."""
    adapter = plan.sizes.adapter
    rule = getattr(adapter, "image_tokens_uncapped", None) or adapter.image_tokens
    out: list[ImageSize] = []
    width = 56
    while True:
        height = max(1, round(width * ratio))
        tokens = rule(width, height).num_tokens
        if not out or tokens != out[-1].tokens:
            per_token = plan.sizes.embedding_bytes_per_token
            out.append(ImageSize(width, height, tokens, tokens, width, height, tokens * per_token, 0, None, None))
        if tokens >= max_tokens or width > 20000 or len(out) > 200:
            return out
        width = max(width + 1, round(width * 1.1))


def _colocated_vs_disaggregated(plan: Plan, model: cm.CostModel, path: Path) -> PlotFile:
    kinds = list(plan.kinds)
    first = cm.solve_load(model, kinds, plan.traffic, "co-located", workers=1, rate=1e-6)
    limit = _unstable_rate(model, kinds, plan, first.request_s)
    rates = [limit * (i + 1) / 40 for i in range(40)]
    series: dict[str, list[float]] = {"disaggregated": [], "co-located": []}
    for rate in rates:
        for mode in series:
            load = cm.solve_load(model, kinds, plan.traffic, mode, workers=1, rate=rate)
            ok = load.stable and math.isfinite(load.request_s)
            series[mode].append(1000 * load.request_s if ok else math.nan)
    fig, ax = _figure()
    ax.plot(rates, series["disaggregated"], label="disaggregated (encoder pool, embeddings pushed)")
    ax.plot(rates, series["co-located"], label="co-located (the worker runs the tower)")
    chosen = plan.disaggregated
    if chosen is not None and chosen.workers:
        ax.axvline(chosen.rate / chosen.workers, color="grey", linestyle=":", label="this traffic, per worker")
    ax.set_xlabel("requests per second per worker")
    ax.set_ylabel("mean request time (ms)")
    ax.set_title("Total request time: co-located against disaggregated")
    return _save(fig, ax, path)


def _unstable_rate(model: cm.CostModel, kinds: list[cm.KindSizes], plan: Plan, base_s: float) -> float:
    """About the rate at which one co-located worker stops keeping up (bisection), or 20 / base time."""
    low, high = 0.0, 20.0 / max(base_s, 1e-6)
    if cm.solve_load(model, kinds, plan.traffic, "co-located", workers=1, rate=high).stable:
        return high
    for _ in range(30):
        middle = (low + high) / 2
        if cm.solve_load(model, kinds, plan.traffic, "co-located", workers=1, rate=middle).stable:
            low = middle
        else:
            high = middle
    return max(low, 1e-3) * 1.2


def _hit_rate(plan: Plan, model: cm.CostModel, path: Path) -> PlotFile:
    kinds = list(plan.kinds)
    batch = plan.disaggregated.batch if plan.disaggregated else 1.0
    rates = [i / 40 for i in range(41)]
    with_cache = [1000 * cm.mix_times(model, kinds, batch, h, 0.0).mean("disaggregated_s") for h in rates]
    without = 1000 * cm.no_cache_s(cm.mix_times(model, kinds, batch, 0.0, 0.0))
    fig, ax = _figure()
    ax.plot(rates, with_cache, label="with the embedding cache")
    ax.axhline(without, color="black", linestyle="--", label="no cache (every image encoded and pushed)")
    break_even = cm.cache_break_even(cm.mix_times(model, kinds, batch, 0.0, 0.0))
    if break_even is not None:
        ax.axvline(break_even, color="red", linestyle=":", label=f"break-even ({break_even:.1%})")
    reuse = plan.traffic.reuse
    ax.axvline(reuse, color="grey", linestyle=":", label=f"this traffic's reuse ({reuse:.0%})")
    ax.set_xlabel("embedding cache hit rate")
    ax.set_ylabel("mean request time (ms)")
    ax.set_title("Request time against cache hit rate")
    return _save(fig, ax, path)


def _figure() -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Any, ax: Any, path: Path) -> PlotFile:
    ax.legend(fontsize="small")
    fig.tight_layout()
    legend = ax.get_legend()
    labels = tuple(text.get_text() for text in legend.get_texts()) if legend is not None else ()
    described = PlotFile(path, ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), labels)
    fig.savefig(path, format="png")
    return described
