"""Benchmark: an OpenAI-compatible server's streamed chat completions (text, fresh and repeated images), any server.

The same client measures every server (ours against vLLM on its own benchmark's terms).

    epd bench serve [--base-url http://127.0.0.1:PORT [--router-pid PID]] [--compare-url URL [--compare-pid PID]]
                    [--num-requests 64] [--concurrency 16 | --request-rate R] [--max-tokens 64]

Three workloads, each `--num-requests` requests streamed (SSE) to `/v1/chat/completions` with `ignore_eos` and
`--max-tokens` tokens each: `text` (a prompt of about `--prompt-words` random words, its own first word so no
two share a prefix beyond the chat template), `fresh-image` (one never-seen `--image-size` image per request,
a data: URL JPEG or PNG of seeded noise, a seed of its own per request and run: no cache can hit) and
`repeated-image` (the fresh-image pass's requests again: the servers' image caches may hit). `--concurrency`
closed-loop clients, or Poisson arrivals at `--request-rate` per second. A few untimed warm-up requests come
first; every workload has a deadline (`--timeout-s`), after which what has not ended is cancelled and counted
as unfinished.

Without `--base-url` it starts a local epd cluster (router, encoder, worker, a private Redis, free 127.0.0.1
ports, a tiny model in a temporary folder) and stops it at the end. With `--compare-url` a second server is
measured in the same run by the same client, workload by workload alternately (both see the box in the same
minutes), and ratios ours / theirs are printed.

Per workload: completed, refused (HTTP 429/503) and failed requests, the refusals' latency (send to the refusal)
p50/p99, output tokens/s (streamed tokens over the workload's wall time), TTFT p50/p99 (send to the first chunk
with content), ITL p50/p99 (between chunk arrivals; a chunk of k tokens is one gap and k - 1 zero gaps; tokens the
final usage counts beyond what the chunks showed, their text held back and sent with a later chunk, are zero gaps
too; streamed tokens are the usage's count, else the chunks'), and, for the cluster it started or a
`--router-pid`, the router process's CPU seconds over the workload (psutil, else /proc/PID/stat utime + stime; the
process alone, not its children) per streamed token: "router CPU ms per token". The client's own CPU seconds are
in the JSON too (on a small box it competes with the servers), and both event loops' lag p99 over the workload: the
router's from its `epd_event_loop_lag_seconds` buckets (an upper bound; when its metrics port is known), the
client's own (the same watch in this process: a client that lags inflates every latency it reports); the readings
are tests/bench/meters.py's. A table, then one JSON line (`--json FILE` writes it to a file as well).

Overload: an open-loop rate far above what the cluster serves (`--workloads fresh-image --request-rate 100
--num-requests 600`, images faster than the encoder's 20 s budget drains) measures how fast refusals come.
For the cluster it started, the router's `request finished` lines of refused requests give a profile per
refusal reason (their time in the router, when they passed intake, the cache lookup and placement), and
after the last workload a leak check waits until nothing is held (tests/bench/leak_check.py: KV blocks
reserved, requests running or waiting and pinned embeddings at the workers, admitted items, preprocessing
slots and tower queue at the encoders, requests in flight at the router) and prints what still is;
`--redis-url` and `--router-metrics-port` give it for a `--base-url` cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common import loop_lag
from tests.bench import leak_check
from tests.bench.meters import CpuMeter, client_cpu_s, router_lag_buckets
from tests.bench.openai_stream import Endpoint, Outcome
from tests.bench.serve_report import bucket_p99_ms, figure, lag_line, ratios, summarize, table
from tests.bench.workload import WORDS, percentile

if TYPE_CHECKING:
    from services.launch.local import LocalCluster

WORKLOADS = ("text", "fresh-image", "repeated-image")


@dataclass(frozen=True)
class Settings:
    num_requests: int = 64
    concurrency: int = 16
    request_rate: float = 0.0  # > 0: Poisson arrivals at this rate instead of closed-loop clients
    max_tokens: int = 64
    prompt_words: int = 256
    image_size: tuple[int, int] = (448, 448)
    image_format: str = "jpeg"
    timeout_s: float = 300.0
    warmup: int = 2
    seed: int = 0  # 0: a seed of the run's own (fresh images are never seen before, even by a long-lived server)


@dataclass
class Server:
    """One server measured: where it is, the model to name, the process whose CPU is counted (0: none), and for
    an epd cluster its registry, router metrics port and router log (JSON lines), read by the leak check and the
    refusal profile (empty: not known)."""

    name: str
    endpoint: Endpoint
    model: str
    pid: int = 0
    started: bool = False
    redis_url: str = ""
    router_metrics_port: int = 0
    router_log: Path | None = None


def image_bytes(settings: Settings, seed: int) -> bytes:
    """One image of seeded noise over a gradient, encoded as ``settings.image_format``."""
    from tests import media_factory

    width, height = settings.image_size
    if settings.image_format == "png":
        return media_factory.png(width, height, seed=seed)
    return media_factory.jpeg(width, height, seed=seed)


def text_body(model: str, settings: Settings, rng: random.Random, tag: str) -> dict[str, Any]:
    words = [tag, *(rng.choice(WORDS) for _ in range(settings.prompt_words - 1))]
    return _body(model, settings, " ".join(words))


def image_body(model: str, settings: Settings, data: bytes, tag: str) -> dict[str, Any]:
    mime = "image/png" if settings.image_format == "png" else "image/jpeg"
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"{tag}: describe it."}]
    return _body(model, settings, parts)


def _body(model: str, settings: Settings, content: str | list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": settings.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def workload_bodies(settings: Settings, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Each workload's request bodies, the model left blank (filled per server): the fresh-image and
    repeated-image workloads send the same images."""
    rng = random.Random(seed)
    text = [text_body("", settings, rng, f"t{seed}-{i}") for i in range(settings.num_requests)]
    images = [
        image_body("", settings, image_bytes(settings, seed * 1000 + i), f"image {seed}-{i}")
        for i in range(settings.num_requests)
    ]
    return {"text": text, "fresh-image": images, "repeated-image": images}


def warmup_bodies(settings: Settings, seed: int) -> list[dict[str, Any]]:
    """Untimed requests first, text and image alternately, with images of their own."""
    rng = random.Random(seed + 1)
    bodies = []
    for i in range(settings.warmup):
        if i % 2:
            bodies.append(image_body("", settings, image_bytes(settings, seed * 1000 - 1 - i), f"warm {seed}-{i}"))
        else:
            bodies.append(text_body("", settings, rng, f"w{seed}-{i}"))
    return bodies


async def run_requests(
    endpoint: Endpoint, bodies: list[bytes], settings: Settings, rng: random.Random
) -> tuple[list[Outcome], float]:
    """Send every body (closed loop, or Poisson arrivals at ``settings.request_rate``); returns the outcomes and
    the wall time from the first send to the last end. Whatever has not ended by ``settings.timeout_s`` is
    cancelled (its outcome's ``error`` says so)."""
    outcomes = [Outcome() for _ in bodies]

    async def one(i: int) -> None:
        try:
            await endpoint.stream(bodies[i], outcomes[i])
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            outcomes[i].error = f"{type(exc).__name__}: {exc}"[:200]
            outcomes[i].ended = time.perf_counter()

    start = time.perf_counter()
    tasks: list[asyncio.Task] = []
    if settings.request_rate > 0:

        async def arrivals() -> None:
            clock = 0.0
            for i in range(len(bodies)):
                await asyncio.sleep(max(0.0, clock - (time.perf_counter() - start)))
                tasks.append(asyncio.create_task(one(i)))
                clock += rng.expovariate(settings.request_rate)

        tasks.append(asyncio.create_task(arrivals()))
    else:
        queue = iter(range(len(bodies)))

        async def client() -> None:
            for i in queue:
                await one(i)

        tasks += [asyncio.create_task(client()) for _ in range(min(settings.concurrency, len(bodies)))]
    deadline = start + settings.timeout_s
    while pending := [t for t in tasks if not t.done()]:  # arrivals add tasks while it waits
        await asyncio.wait(pending, timeout=max(0.0, deadline - time.perf_counter()))
        if time.perf_counter() >= deadline:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            break
    for outcome in outcomes:
        if not outcome.ended:
            outcome.error = "unfinished by the deadline" if outcome.sent else "not sent by the deadline"
            outcome.ended = time.perf_counter()
    endpoint.close_idle()  # kept connections belong to this loop
    ends = [o.ended for o in outcomes if o.ended]
    return outcomes, (max(ends) if ends else time.perf_counter()) - start


def _encoded(bodies: list[dict[str, Any]], model: str) -> list[bytes]:
    return [json.dumps({**body, "model": model}).encode() for body in bodies]


async def measure_workload(server: Server, bodies: list[dict[str, Any]], settings: Settings, seed: int) -> dict:
    """One workload against one server, its router's CPU counted when its process is known."""
    encoded = _encoded(bodies, server.model)
    meter = CpuMeter(server.pid) if server.pid else None
    log_from = leak_check.log_size(server.router_log) if server.router_log else 0
    cpu_before, client_before = (meter.seconds() if meter else 0.0), client_cpu_s()
    lag_before = router_lag_buckets(server.router_metrics_port)
    client_lags = loop_lag.Samples()
    watch = asyncio.create_task(loop_lag.watch(client_lags))
    outcomes, wall_s = await run_requests(server.endpoint, encoded, settings, random.Random(seed))
    watch.cancel()
    router_cpu = meter.seconds() - cpu_before if meter else None
    figures = summarize(outcomes, wall_s, router_cpu, client_cpu_s() - client_before)
    lag_after = router_lag_buckets(server.router_metrics_port)
    figures["router_loop_lag_p99_ms"] = bucket_p99_ms(lag_before, lag_after) if lag_before and lag_after else None
    figures["client_loop_lag_p99_ms"] = 1000 * percentile(client_lags, 99) if client_lags else None
    if server.router_log is not None and figures["refused"]:
        await asyncio.sleep(0.5)  # the router writes a refusal's line as its generator closes
        figures["refusal_profile"] = leak_check.refusal_profile(server.router_log, log_from)
    return figures


async def measure(servers: list[Server], settings: Settings, workloads: list[str]) -> dict[str, dict[str, dict]]:
    """Warm-up, then each workload on every server in turn; ``{server name: {workload: figures}}``."""
    seed = settings.seed or (time.time_ns() // 1000) % (1 << 30)
    bodies = workload_bodies(settings, seed)
    warm = warmup_bodies(settings, seed)
    for server in servers:
        await run_requests(server.endpoint, _encoded(warm, server.model), settings, random.Random(0))
    results: dict[str, dict[str, dict]] = {s.name: {} for s in servers}
    for workload in workloads:
        for server in servers:
            results[server.name][workload] = await measure_workload(server, bodies[workload], settings, seed)
    return results


def check_leaks(server: Server) -> dict[str, Any] | None:
    """After the load: what `server` (an epd cluster whose registry is known) still holds (leak_check.py)."""
    if not server.redis_url:
        return None
    return leak_check.wait_until_idle(server.redis_url, server.router_metrics_port)


def _exit_on_sigterm(_signum: int, _frame: object) -> None:
    raise SystemExit(143)


@contextlib.contextmanager
def local_cluster(
    startup_timeout_s: float = 180.0, model_dir: Path | None = None, encoders: int = 1
) -> Iterator[LocalCluster]:
    """A local epd cluster with default settings (private Redis, `model_dir` or a tiny model in a temporary
    folder, `encoders` encoder processes (0: the worker encodes, co-located), router HTTP on a free port, logs as
    JSON lines for the refusal profile); yields it, and stops everything on the way out (SIGTERM becomes an exit,
    so a terminated bench stops it too)."""
    from services.launch.local import ClusterSpec, free_port, start_cluster
    from services.models.tiny_model import make_tiny_model
    from tests.redis_server import RedisServer

    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    redis = RedisServer(free_port())
    redis.start()
    try:
        with tempfile.TemporaryDirectory(prefix="epd-bench-serve-") as tmp:
            model = model_dir or make_tiny_model(Path(tmp) / "model", "qwen2-vl")
            spec = ClusterSpec(
                model,
                encoders=encoders,
                redis_url=redis.url,
                free_ports=True,
                env={"EPD_HTTP_PORT": str(free_port()), "EPD_LOG_FORMAT": "json"},
                log_dir=Path(tmp) / "logs",
            )
            cluster = start_cluster(spec, timeout_s=startup_timeout_s)
            try:
                yield cluster
            finally:
                cluster.stop()
    finally:
        redis.stop()
        signal.signal(signal.SIGTERM, previous)


def _server(name: str, url: str, model: str, pid: int, api_key: str, started: bool = False) -> Server:
    endpoint = Endpoint.parse(url, api_key)
    if not model:
        ids = endpoint.models()
        if not ids:
            raise SystemExit(f"{url} lists no model: name one with --model / --compare-model")
        model = ids[0]
    return Server(name, endpoint, model, pid, started)


def cluster_server(cluster: LocalCluster, api_key: str = "") -> Server:
    """The local cluster `local_cluster` started, as the server measured: its router's CPU counted, its
    registry, metrics and log known (the leak check and the refusal profile)."""
    server = _server("ours", cluster.http_url, "", cluster.router.popen.pid, api_key, started=True)
    server.redis_url = cluster.redis_url
    server.router_metrics_port = cluster.router.metrics_port
    server.router_log = cluster.router.log_path
    return server


def profile_lines(workload: str, figures: dict[str, Any]) -> list[str]:
    """Where the refused requests of a workload spent their time in the router, by refusal reason."""
    lines = []
    for reason, p in (figures.get("refusal_profile") or {}).items():
        steps = ", ".join(
            f"{step.removesuffix('_at_s')} at p50 {p[step.removesuffix('_s') + '_p50_ms']:.1f} / "
            f"p99 {p[step.removesuffix('_s') + '_p99_ms']:.1f} ms"
            for step in leak_check.STEPS
            if step.removesuffix("_s") + "_p50_ms" in p
        )
        lines.append(
            f"ours {workload}: {p['count']} refused '{reason}', in the router p50 {p['router_p50_ms']:.1f} ms "
            f"p99 {p['router_p99_ms']:.1f} ms" + (f"; passed {steps}" if steps else "")
        )
    return lines


def leak_line(leaks: dict[str, Any]) -> str:
    """The leak check's verdict in one line."""
    state = leaks["state"]
    held = ", ".join(f"{k} {v}" for k, v in state.items())
    if leaks["leaked"]:
        return f"leak check: STILL HELD after {leaks['waited_s']} s: {leaks['leaked']} ({held})"
    return f"leak check: nothing held {leaks['waited_s']} s after the load ({held})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="epd bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="", help="a running server (default: start a local epd cluster)")
    parser.add_argument("--model", default="", help="the model name to send (default: the first /v1/models lists)")
    parser.add_argument("--router-pid", type=int, default=0, help="the --base-url server's process, for its CPU")
    parser.add_argument("--redis-url", default="", help="the --base-url cluster's registry, for the leak check")
    parser.add_argument("--router-metrics-port", type=int, default=0, help="the --base-url router's metrics port")
    parser.add_argument("--compare-url", default="", help="a second server measured in the same run")
    parser.add_argument("--compare-model", default="", help="the model name for --compare-url")
    parser.add_argument("--compare-pid", type=int, default=0, help="the --compare-url server's process")
    parser.add_argument("--api-key", default="", help="sent as a bearer token to both servers")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per workload")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second instead")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (eos ignored)")
    parser.add_argument("--prompt-words", type=int, default=256, help="the text workload's prompt length")
    parser.add_argument("--image-size", default="448x448", help="WIDTHxHEIGHT")
    parser.add_argument("--image-format", choices=["jpeg", "png"], default="jpeg")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="each workload's deadline")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per server first")
    parser.add_argument("--seed", type=int, default=0, help="0: a seed of the run's own")
    parser.add_argument("--json", type=Path, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}")
    if "repeated-image" in workloads and "fresh-image" not in workloads[: workloads.index("repeated-image")]:
        parser.error("repeated-image repeats a fresh-image pass: list fresh-image before it")
    if not 1 <= args.num_requests <= 10_000 or args.concurrency < 1 or args.max_tokens < 1 or args.prompt_words < 1:
        parser.error("--num-requests (1 to 10000), --concurrency, --max-tokens and --prompt-words must be positive")
    for url in (args.base_url, args.compare_url):
        if url:
            try:
                Endpoint.parse(url)
            except ValueError as exc:
                parser.error(str(exc))
    args.workloads = workloads
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    width, height = (int(v) for v in args.image_size.lower().split("x"))
    settings = Settings(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        image_size=(width, height),
        image_format=args.image_format,
        timeout_s=args.timeout_s,
        warmup=args.warmup,
        seed=args.seed,
    )
    with contextlib.ExitStack() as stack:
        if args.base_url:
            ours = _server("ours", args.base_url, args.model, args.router_pid, args.api_key)
            ours.redis_url, ours.router_metrics_port = args.redis_url, args.router_metrics_port
        else:
            ours = cluster_server(stack.enter_context(local_cluster()), args.api_key)
        servers = [ours]
        if args.compare_url:
            servers.append(_server("theirs", args.compare_url, args.compare_model, args.compare_pid, args.api_key))
        results = asyncio.run(measure(servers, settings, args.workloads))
        leaks = check_leaks(ours)
    load = f"rate {settings.request_rate:g}/s" if settings.request_rate > 0 else f"concurrency {settings.concurrency}"
    print(
        f"{settings.num_requests} requests per workload, {load}, {settings.max_tokens} tokens each (eos ignored), "
        f"text prompts of {settings.prompt_words} words, {width}x{height} {settings.image_format} images"
    )
    for s in servers:
        print(f"{s.name}: {s.endpoint.url} model {s.model}" + (f", router pid {s.pid}" if s.pid else ""))
    print(table(results))
    for workload, f in results["ours"].items():
        for line in profile_lines(workload, f):
            print(line)
        if (lags := lag_line(workload, f)) is not None:
            print(lags)
    if leaks is not None:
        print(leak_line(leaks))
    out: dict[str, Any] = {
        "settings": {**asdict(settings), "workloads": args.workloads},
        "target": {
            "base_url": servers[0].endpoint.url,
            "model": servers[0].model,
            "router_pid": servers[0].pid,
            "started_cluster": servers[0].started,
        },
        "workloads": results["ours"],
        "leak_check": leaks,
        "compare": None,
        "ratios": None,
    }
    if len(servers) > 1:
        theirs = servers[1]
        out["compare"] = {
            "base_url": theirs.endpoint.url,
            "model": theirs.model,
            "pid": theirs.pid,
            "workloads": results["theirs"],
        }
        out["ratios"] = ratios(results["ours"], results["theirs"])
        for workload, r in out["ratios"].items():
            print(
                f"ours / theirs, {workload}: "
                + ", ".join(f"{k} {figure(v, '.2f')}" for k, v in r.items() if k != "router_cpu_ms_per_token")
                + (f", router CPU per token {r['router_cpu_ms_per_token']:.2f}" if r["router_cpu_ms_per_token"] else "")
            )
    line = json.dumps(out)
    print(line)
    if args.json is not None:
        args.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
