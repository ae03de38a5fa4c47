"""`epd bench serve`'s figures: a workload's summary (milliseconds, tokens/s, router CPU per token), the ratios
ours / theirs, and the printed table."""

from __future__ import annotations

import os

from tests.bench.openai_stream import Outcome
from tests.bench.workload import percentile

RATIO_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "router_cpu_ms_per_token")


def _percentile(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarize(outcomes: list[Outcome], wall_s: float, router_cpu_s: float | None, client_cpu_s: float) -> dict:
    """A workload's figures (milliseconds, tokens/s), as printed and put in the JSON line."""
    done = [o for o in outcomes if o.completed]
    refused = [o for o in outcomes if o.refused]
    refusal_ms = [1000 * (o.ended - o.sent) for o in refused]
    ttfts = [1000 * (o.chunks[0][0] - o.sent) for o in done if o.chunks]
    itls: list[float] = []
    for o in done:
        for (a, _), (b, k) in zip(o.chunks, o.chunks[1:], strict=False):
            itls += [1000 * (b - a)] + [0.0] * (k - 1)
        if o.chunks:  # the first chunk's extra tokens, and those the usage counts but no chunk showed
            itls += [0.0] * (o.chunks[0][1] - 1 + max(0, o.usage_tokens - o.tokens))
    tokens = sum(max(o.tokens, o.usage_tokens) for o in outcomes)
    errors = sorted({o.error for o in outcomes if o.error and not o.refused})
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "refused": len(refused),
        "failed": len(outcomes) - len(done) - len(refused),
        "errors": errors[:5],
        "refusal_latency_p50_ms": _percentile(refusal_ms, 50),
        "refusal_latency_p99_ms": _percentile(refusal_ms, 99),
        "output_tokens": tokens,
        "chunk_tokens": sum(o.tokens for o in outcomes),
        "chunks": sum(len(o.chunks) for o in outcomes),
        "multi_token_chunks": sum(k > 1 for o in outcomes for _, k in o.chunks),
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_ms": _percentile(ttfts, 50),
        "ttft_p99_ms": _percentile(ttfts, 99),
        "itl_p50_ms": _percentile(itls, 50),
        "itl_p99_ms": _percentile(itls, 99),
        "router_cpu_s": router_cpu_s,
        "router_cpu_ms_per_token": 1000 * router_cpu_s / tokens if router_cpu_s is not None and tokens else None,
        "client_cpu_s": client_cpu_s,
        "load_average": os.getloadavg()[0],
    }


def bucket_p99_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The smallest bucket bound (ms) holding 99 % of the samples a histogram took between two scrapes (its
    cumulative counts by bound): an upper bound of their p99; None without samples, infinity past the last bound."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    return next(1000 * b for b, c in zip(bounds, counts, strict=True) if c >= 0.99 * counts[-1])


def lag_line(workload: str, figures: dict) -> str | None:
    """The event loops' lag over a workload (router: from its metrics; client: this process), or None."""
    router, client = figures.get("router_loop_lag_p99_ms"), figures.get("client_loop_lag_p99_ms")
    if router is None and client is None:
        return None
    parts = [] if router is None else [f"router <= {router:g} ms"]
    parts += [] if client is None else [f"this client {client:.1f} ms"]
    return f"ours {workload}: event-loop lag p99 " + ", ".join(parts)


def ratios(ours: dict[str, dict], theirs: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Ours / theirs per workload and figure (None where either is missing or theirs is 0)."""
    out: dict[str, dict[str, float | None]] = {}
    for workload, mine in ours.items():
        other = theirs.get(workload, {})
        out[workload] = {
            key: mine[key] / other[key] if mine.get(key) is not None and other.get(key) else None for key in RATIO_KEYS
        }
    return out


def figure(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def table(results: dict[str, dict[str, dict]]) -> str:
    """The compact table: a row per server and workload."""
    header = (
        f"{'server':8s} {'workload':15s} {'done':>5s} {'refused':>7s} {'ref p50':>8s} {'ref p99':>8s} "
        f"{'tok/s':>8s} {'TTFT p50':>9s} {'p99':>8s} {'ITL p50':>8s} {'p99':>7s} {'router ms/tok':>13s}"
    )
    rows = [header]
    for name, workloads in results.items():
        for workload, f in workloads.items():
            rows.append(
                f"{name:8s} {workload:15s} {f['completed']:>2d}/{f['requests']:<2d} {f['refused']:>7d} "
                f"{figure(f['refusal_latency_p50_ms'], '.1f'):>8s} {figure(f['refusal_latency_p99_ms'], '.1f'):>8s} "
                f"{f['tokens_per_s']:8.1f} {figure(f['ttft_p50_ms'], '.1f'):>9s} {figure(f['ttft_p99_ms'], '.1f'):>8s} "
                f"{figure(f['itl_p50_ms'], '.2f'):>8s} {figure(f['itl_p99_ms'], '.2f'):>7s} "
                f"{figure(f['router_cpu_ms_per_token'], '.3f'):>13s}"
            )
    return "\n".join(rows)
