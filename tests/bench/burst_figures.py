"""`epd bench burst`'s figures: the settings of a run, what each episode recorded, and the gaps, stalls and
rates summarised from the clients' token times (as printed and put in the JSON line).

Invariants: every figure comes from the clients' own clocks (perf_counter seconds at each token's arrival);
a gap belongs to the burst window when it overlaps it; the quiet gaps skip the first fifth of the quiet tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tests.bench.burst_clients import Stream
from tests.bench.workload import percentile


@dataclass(frozen=True)
class Settings:
    streams: int
    images: int
    image_size: tuple[int, int]
    quiet_tokens: int
    stream_tokens: int
    image_tokens: int
    bursts: int


@dataclass
class Episode:
    """One burst: the streams, the images, and when the images were sent."""

    streams: list[Stream]
    images: list[Stream]
    burst_at: float

    @property
    def window_end(self) -> float:
        """The last image's first token: every image prefilled."""
        return max(s.token_times[0] for s in self.images)


@dataclass
class RunResult:
    """One cluster's run: its episodes, and its worker's step-cost metrics at the end."""

    episodes: list[Episode]
    worker_metrics: str = ""
    load_average: float = 0.0  # the box's 1-minute load average at the end (other work on it skews everything)
    remote_prefills: float = 0.0  # a P/D cluster's: requests its router had prefilled on the prefill worker


CALIBRATION_EPISODES = 2
"""Episodes of the no-target cluster whose pooled quiet inter-token p99 sets the target (~2,500 gaps: one
episode's ~1,300 put the p99 anywhere from 9 to 15 ms on a 2-core box whose runs' p99 sat at 10-12)."""


def _gaps(times: list[float], start: float, end: float) -> list[tuple[float, float]]:
    """(gap, its end) for consecutive times whose gap overlaps ``[start, end]``."""
    return [(b - a, b) for a, b in zip(times, times[1:], strict=False) if b > start and a < end]


def summarize(run: RunResult, settings: Settings) -> dict[str, float | list[float]]:
    """The run's figures (milliseconds, tokens/s) as printed and put in the JSON line: quiet gaps pooled over the
    episodes; per episode the median over streams of their worst burst stall, and the run's typical one the
    median over episodes; tokens/s over all episodes' after-burst time."""
    skip = max(1, settings.quiet_tokens // 5)
    quiet: list[float] = []
    burst: list[float] = []
    joined: list[float] = []  # the streams' gaps after the window while the images decode: no prefill left
    worst: list[list[float]] = []
    quiet_worst: list[float] = []  # per episode, the median over streams of their worst quiet gap: the noise floor
    worst_at: list[float] = []  # per episode, when (after the burst's send) the streams' worst stall began
    ttfts: list[float] = []
    tokens = seconds = 0.0
    for ep in run.episodes:
        per_stream_worst = []
        for s in ep.streams:
            times = s.token_times[skip:]
            gaps_before = [b - a for a, b in zip(times, times[1:], strict=False) if b <= ep.burst_at]
            quiet += gaps_before
            per_stream_worst.append(max(gaps_before, default=0.0))
        quiet_worst.append(statistics.median(per_stream_worst))
        gaps = [_gaps(s.token_times, ep.burst_at, ep.window_end) for s in ep.streams]
        worst_gaps = [max(g, default=(0.0, ep.burst_at)) for g in gaps]
        worst.append([w for w, _ in worst_gaps])
        worst_at.append(statistics.median(end - w - ep.burst_at for w, end in worst_gaps))
        burst += [g for per_stream in gaps for g, _ in per_stream]
        images_end = max(s.token_times[-1] for s in ep.images)
        for s in ep.streams:
            pairs = zip(s.token_times, s.token_times[1:], strict=False)
            joined += [b - a for a, b in pairs if ep.window_end <= a and b <= images_end]
        ttfts += [s.token_times[0] - s.sent for s in ep.images]
        after = [t for s in ep.streams + ep.images for t in s.token_times if t > ep.burst_at]
        tokens += len(after)
        seconds += max(after) - ep.burst_at
    quiet_p99 = percentile(quiet, 99)
    stalls = [statistics.median(w) for w in worst]
    return {
        "quiet_itl_p50_ms": 1000 * percentile(quiet, 50),
        "quiet_itl_p99_ms": 1000 * quiet_p99,
        "quiet_itl_max_ms": 1000 * max(quiet, default=0.0),
        "quiet_gaps": len(quiet),
        "quiet_typical_worst_ms": 1000 * statistics.median(quiet_worst),
        "quiet_stall_ratio": statistics.median(quiet_worst) / quiet_p99 if quiet_p99 > 0 else float("nan"),
        "burst_itl_p50_ms": 1000 * percentile(burst, 50),
        "burst_itl_p99_ms": 1000 * percentile(burst, 99),
        "burst_itl_max_ms": 1000 * max(burst, default=0.0),
        "joined_itl_p50_ms": 1000 * percentile(joined, 50),
        "joined_itl_p99_ms": 1000 * percentile(joined, 99),
        "joined_gaps": len(joined),
        "burst_window_ms": [round(1000 * (ep.window_end - ep.burst_at)) for ep in run.episodes],
        "worst_stall_ms": [[round(1000 * w, 1) for w in per_episode] for per_episode in worst],
        "typical_worst_stall_ms": 1000 * statistics.median(stalls),
        "worst_stall_began_ms": [round(1000 * t) for t in worst_at],
        "image_ttft_p50_ms": 1000 * statistics.median(ttfts),
        "image_ttft_max_ms": 1000 * max(ttfts),
        "tokens_per_s": tokens / seconds,
        "coalesced_messages": sum(s.coalesced for ep in run.episodes for s in ep.streams + ep.images),
        "streams_outlasted_bursts": all(s.token_times[-1] >= ep.window_end for ep in run.episodes for s in ep.streams),
        "stall_ratio": statistics.median(stalls) / quiet_p99 if quiet_p99 > 0 else float("nan"),
        "load_average": run.load_average,
    }


def print_run(name: str, figures: dict) -> None:
    """Two lines of `summarize`'s figures for the run called ``name``."""
    f = figures
    print(
        f"{name:9s} quiet ITL p50 {f['quiet_itl_p50_ms']:6.2f} ms p99 {f['quiet_itl_p99_ms']:6.2f} "
        f"max {f['quiet_itl_max_ms']:6.1f} ms typical worst {f['quiet_typical_worst_ms']:5.1f} ms "
        f"({f['quiet_stall_ratio']:.2f}x) | burst ITL "
        f"p50 {f['burst_itl_p50_ms']:6.2f} p99 {f['burst_itl_p99_ms']:7.2f} max {f['burst_itl_max_ms']:7.2f} ms | "
        f"typical worst stall {f['typical_worst_stall_ms']:6.1f} ms | joined ITL p50 {f['joined_itl_p50_ms']:6.2f} "
        f"p99 {f['joined_itl_p99_ms']:6.2f} ms | image TTFT p50 {f['image_ttft_p50_ms']:.0f} "
        f"max {f['image_ttft_max_ms']:.0f} ms | {f['tokens_per_s']:.0f} tok/s | stall ratio {f['stall_ratio']:.2f}"
    )
    print(
        f"{name:9s} bursts' prefill windows (ms): {f['burst_window_ms']}; worst stall per stream (ms): "
        f"{f['worst_stall_ms']}, beginning {f['worst_stall_began_ms']} ms after the burst; messages carrying "
        f"several tokens: {f['coalesced_messages']}; streams outlasted the bursts: {f['streams_outlasted_bursts']}; "
        f"load average {f['load_average']:.1f}"
    )
