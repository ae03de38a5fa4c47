"""`epd bench vllm`'s figures: vLLM's benchmark client's result in `epd bench serve`'s names, the ratios
epd / vLLM per client and workload, the acceptance checks, the side-by-side table and each server's CPU per
output token.

Every figure is the client's own: `epd bench serve`'s summary for our client, vLLM's result JSON for vLLM's
(`output_throughput`, `p50`/`p99` of `ttft`, `itl`, `tpot` with `--metric-percentiles 50,99`). A ratio is
epd / vLLM, None where either side is missing or vLLM's is 0.
"""

from __future__ import annotations

from typing import Any

from tests.bench.serve_report import figure

RATIO_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
IMAGE_WORKLOADS = ("fresh-image", "repeated-image")

# (workload, figure, bound, "min" | "max"): the ratio epd / vLLM each side-by-side target asks for.
TARGETS: tuple[tuple[str, str, float, str], ...] = (
    ("text", "tokens_per_s", 1.3, "min"),
    ("fresh-image", "tokens_per_s", 1.2, "min"),
    ("fresh-image", "ttft_p99_ms", 1.0, "max"),
    ("repeated-image", "tokens_per_s", 2.0, "min"),
    ("fresh-image", "itl_p99_ms", 1 / 3, "max"),
    ("repeated-image", "itl_p99_ms", 1 / 3, "max"),
)


def client_figures(result: dict[str, Any]) -> dict[str, Any]:
    """vLLM's benchmark client's result JSON (one workload against one server) in `epd bench serve`'s names."""
    completed, failed = int(result.get("completed", 0)), int(result.get("failed", 0))
    errors = sorted({e for e in result.get("errors") or [] if e})
    return {
        "requests": int(result.get("num_prompts", completed + failed)),
        "completed": completed,
        "failed": failed,
        "errors": [e[:200] for e in errors[:5]],
        "output_tokens": result.get("total_output_tokens"),
        "wall_s": result.get("duration"),
        "tokens_per_s": result.get("output_throughput") or 0.0,
        "ttft_p50_ms": result.get("p50_ttft_ms", result.get("median_ttft_ms")),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "itl_p50_ms": result.get("p50_itl_ms", result.get("median_itl_ms")),
        "itl_p99_ms": result.get("p99_itl_ms"),
        "tpot_p50_ms": result.get("p50_tpot_ms", result.get("median_tpot_ms")),
        "tpot_p99_ms": result.get("p99_tpot_ms"),
    }


def ratios(epd: dict[str, dict], vllm: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """epd / vLLM per workload (both sides measured by one client) and figure."""
    out: dict[str, dict[str, float | None]] = {}
    for workload, ours in epd.items():
        theirs = vllm.get(workload) or {}
        out[workload] = {
            key: ours[key] / theirs[key] if ours.get(key) is not None and theirs.get(key) else None
            for key in RATIO_KEYS
        }
    return out


def acceptance(by_client: dict[str, dict[str, dict[str, float | None]]]) -> list[dict[str, Any]]:
    """Each target against each client's ratios: `met` is None where the ratio is missing (a workload not run,
    or a side without figures)."""
    rows = []
    for client, workloads in by_client.items():
        for workload, key, bound, kind in TARGETS:
            value = (workloads.get(workload) or {}).get(key)
            met = None if value is None else (value >= bound if kind == "min" else value <= bound)
            rows.append(
                {"client": client, "workload": workload, "figure": key, "ratio": value, kind: bound, "met": met}
            )
    return rows


def cpu_lines(results: dict[str, dict[str, dict[str, dict]]]) -> list[str]:
    """Per client and workload, each server's CPU per output token (its processes' CPU seconds over the client's
    run, ``server_cpu_s``, in ms per token) and the ratio epd / vLLM; none where no side has the figure."""
    lines = []
    for client, servers in results.items():
        epd, vllm = servers.get("epd", {}), servers.get("vllm", {})
        for workload in epd:
            ours, theirs = (_cpu_ms_per_token(f.get(workload, {})) for f in (epd, vllm))
            if ours is None and theirs is None:
                continue
            ratio = ours / theirs if ours is not None and theirs else None
            lines.append(
                f"{client:7s} {workload:15s} server CPU ms per output token: epd {figure(ours, '.3f')}, "
                f"vLLM {figure(theirs, '.3f')} (ratio {figure(ratio, '.2f')})"
            )
    return lines


def _cpu_ms_per_token(f: dict[str, Any]) -> float | None:
    cpu, tokens = f.get("server_cpu_s"), f.get("output_tokens")
    return 1e3 * cpu / tokens if cpu is not None and tokens else None


def _done(f: dict[str, Any]) -> str:
    return f"{f.get('completed', 0)}/{f.get('requests', 0)}"


def table(results: dict[str, dict[str, dict[str, dict]]]) -> str:
    """One row per client and workload: each server's tok/s, TTFT p99 and ITL p99 side by side with the ratio
    epd / vLLM. `results` is {client: {"epd"|"vllm": {workload: figures}}}."""
    header = (
        f"{'client':7s} {'workload':15s} {'done':>11s} {'tok/s epd':>10s} {'vLLM':>8s} {'ratio':>6s} "
        f"{'TTFT p99 epd':>13s} {'vLLM':>8s} {'ratio':>6s} {'ITL p99 epd':>12s} {'vLLM':>8s} {'ratio':>6s}"
    )
    rows = [header]
    for client, servers in results.items():
        epd, vllm = servers.get("epd", {}), servers.get("vllm", {})
        r = ratios(epd, vllm)
        for workload in epd:
            ours, theirs = epd[workload], vllm.get(workload, {})
            rows.append(
                f"{client:7s} {workload:15s} {_done(ours) + ' ' + _done(theirs):>11s} "
                f"{figure(ours.get('tokens_per_s'), '.1f'):>10s} {figure(theirs.get('tokens_per_s'), '.1f'):>8s} "
                f"{figure(r[workload]['tokens_per_s'], '.2f'):>6s} "
                f"{figure(ours.get('ttft_p99_ms'), '.1f'):>13s} {figure(theirs.get('ttft_p99_ms'), '.1f'):>8s} "
                f"{figure(r[workload]['ttft_p99_ms'], '.2f'):>6s} "
                f"{figure(ours.get('itl_p99_ms'), '.2f'):>12s} {figure(theirs.get('itl_p99_ms'), '.2f'):>8s} "
                f"{figure(r[workload]['itl_p99_ms'], '.2f'):>6s}"
            )
    return "\n".join(rows)


def acceptance_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The acceptance rows as printed: 'client workload figure ratio >= bound: met / not met / no figure'."""
    lines = []
    for row in rows:
        kind = "min" if "min" in row else "max"
        sign = ">=" if kind == "min" else "<="
        verdict = {True: "met", False: "NOT met", None: "no figure"}[row["met"]]
        lines.append(
            f"{row['client']:7s} {row['workload']:15s} {row['figure']:12s} epd/vLLM "
            f"{figure(row['ratio'], '.2f'):>6s} {sign} {row[kind]:.2f}: {verdict}"
        )
    return lines
