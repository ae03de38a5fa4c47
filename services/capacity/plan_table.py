"""`epd plan`'s report as text for a terminal: the JSON report (`plan.plan_json`) laid out in aligned columns."""

from __future__ import annotations

from typing import Any

from services.capacity.plan import MIB


def _width(model: dict[str, Any]) -> str:
    """How the embedding row is wider than the hidden size (DeepStack levels travel with it), or nothing."""
    width, hidden = model.get("embedding_width", model["hidden_size"]), model["hidden_size"]
    return "" if width == hidden else f" ({width // hidden} x hidden: main + {width // hidden - 1} DeepStack levels)"


def plan_table(report: dict[str, Any]) -> str:
    """The JSON report as text for a terminal."""
    m = report["model"]
    lines = [
        f"model {m['model_type']} ({m['dir']}), {m['dtype']}: {m['layers']} layers x {m['kv_heads']} KV heads x "
        f"head dim {m['head_dim']}, hidden {m['hidden_size']}",
        f"KV per token {report['kv_bytes_per_token']:,} B; embedding per image token "
        f"{report['embedding_bytes_per_token']:,} B{_width(m)}",
        "images:",
    ]
    seen = set()
    for kind in report["requests"]:
        for image in kind["images"]:
            if image["size"] in seen:
                continue
            seen.add(image["size"])
            lines.append("  " + _image_line(image))
    if not seen:
        lines.append("  (none)")
    videos = [v for kind in report["requests"] for v in kind["videos"]]
    if videos:
        lines.append("videos:")
        lines += ["  " + _video_line(v) for v in {_video_line(v): v for v in videos}.values()]
    timed = report["times"] is not None
    header = ["request kind", "share", "media tok", "prompt", "out", "KV MiB", "emb MiB"]
    if timed:
        header += ["encode", "xfer", "prefill", "decode", "serve", "TTFT", "total", "co-loc"]
    rows = [header]
    for kind in report["requests"]:
        row = [
            kind["label"],
            f"{kind['share']:.2f}",
            f"{kind['image_tokens'] + kind['video_tokens']:,}",
            f"{kind['prompt_tokens']:,}",
            f"{kind['output_tokens']:,}",
            _mib(kind["kv_bytes"]),
            _mib(kind["embedding_bytes"]),
        ]
        if timed:
            t = kind["times"]
            row += [
                _ms(t[k])
                for k in (
                    "encode_s",
                    "transfer_s",
                    "prefill_s",
                    "decode_s",
                    "serving_s",
                    "ttft_s",
                    "request_s_disaggregated",
                    "request_s_colocated",
                )
            ]
        rows.append(row)
    lines.append("request kinds (times in ms; total = disaggregated request time):")
    lines += ["  " + line for line in _columns(rows)]
    if not timed:
        lines.append(report["note"])
        return "\n".join(lines)
    t, d, c = report["times"], report["deployment"], report["cache"]
    lines.append(
        f"mean request: {_ms(t['request_s_disaggregated'])} ms disaggregated, {_ms(t['request_s_colocated'])} ms "
        f"co-located; TTFT {_ms(t['ttft_s'])} ms, ITL {_ms(t['itl_s'])} ms"
    )
    ratio = d["encoder_worker_ratio"]
    lines.append(
        f"deployment: {d['recommendation']} ({'; '.join(d['reasons'])}); {d['workers']} worker(s)"
        + (f", {d['encoders']} encoder(s)" if d["recommendation"] == "disaggregated" else "")
        + (f"; encoder:worker busy time {ratio:.2f}:1" if ratio is not None else "")
    )
    lines.append(
        f"per worker: {d['batch_per_worker']:.1f} sequences decoding, KV {_bytes(d['kv_bytes_per_worker'])}; "
        f"{d['request_rate']:.2f} requests/s over {d['requests_in_system']:.1f} in the system"
        + ("" if d["stable"] else " (NOT stable: a pool is over capacity)")
    )
    for name, target in d["targets"].items():
        if target["target"] is not None:
            verdict = "met" if target["met"] else "MISSED"
            lines.append(f"target {name}: {target['target']:g}, predicted {target['predicted']:.1f}: {verdict}")
    lines += [f"WARNING: {warning}" for warning in report.get("warnings", [])]
    be = c["break_even_hit_rate"]
    lines.append(
        f"embedding cache: pays above a {be:.1%} hit rate (traffic's reuse {c['reuse']:.0%}: "
        f"{'pays' if c['pays'] else 'does not pay'})"
        if be is not None
        else f"embedding cache: never pays on this hardware (reading costs as much as encoding; reuse {c['reuse']:.0%})"
    )
    pd = report.get("prefill_decode")
    if pd is not None:
        ratio = pd["ratio"]
        lines.append(
            f"prefill/decode: {pd['recommendation']} ({'; '.join(pd['reasons'])})"
            + (
                f"; EPD_PD_MIN_PREFILL_TOKENS={pd['threshold_tokens']}, time to first token "
                f"+{1000 * pd['ttft_cost_s']:.1f} ms for those sent; encoder : prefill : decode = "
                f"{ratio['encoder']:.2f} : {ratio['prefill']:.2f} : 1"
                if pd["threshold_tokens"] is not None
                else ""
            )
        )
    return "\n".join(lines)


def _image_line(image: dict[str, Any]) -> str:
    line = f"{image['size']}: {image['tokens']:,} tokens"
    if image["tokens_uncapped"] is not None and image["tokens_uncapped"] != image["tokens"]:
        line += f" ({image['tokens_uncapped']:,} uncapped)"
    kv, embedding = _bytes(image["kv_bytes"]), _bytes(image["embedding_bytes"])
    line += f", resized {image['resized']}; KV {kv} vs embedding {embedding}"
    if image["tokens_uncapped"] is not None and image["tokens_uncapped"] != image["tokens"]:
        kv, embedding = _bytes(image["kv_bytes_uncapped"]), _bytes(image["embedding_bytes_uncapped"])
        line += f"; uncapped: KV {kv} vs embedding {embedding}"
    return line


def _video_line(video: dict[str, Any]) -> str:
    kv, embedding = _bytes(video["kv_bytes"]), _bytes(video["embedding_bytes"])
    return (
        f"{video['size']} {video['seconds']:g} s at {video['fps']:g} fps: {video['frames']} frames sampled, "
        f"{video['tokens']:,} tokens, resized {video['resized']}; KV {kv} vs embedding {embedding}"
    )


def _bytes(value: float) -> str:
    """`94.5 MiB (99.1 MB)` style: binary and decimal megabytes (both are in use)."""
    if value < 1e6:
        return f"{value / 1024:.1f} KiB ({value / 1e3:.1f} kB)"
    if value < 1e9:
        return f"{value / MIB:.1f} MiB ({value / 1e6:.1f} MB)"
    return f"{value / (1 << 30):.2f} GiB ({value / 1e9:.2f} GB)"


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(_cell(c, w, i == 0) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]


def _cell(text: str, width: int, left: bool) -> str:
    return text.ljust(width) if left else text.rjust(width)
