"""The `epd` command: serve, up, demo, generate, count, health, make-tiny-model, bench."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
import sys
from pathlib import Path

from services.common import config as config_lib

DEFAULT_TINY = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "epd" / "tiny-qwen2-vl"


def _serve(args: argparse.Namespace) -> int:
    from services.common.service_main import run_until_signalled, setup_logging
    from services.serve import CONFIGS, start_role

    config = config_lib.load(CONFIGS[args.role], args)
    setup_logging(config.log_level)
    if config.torch_threads > 0:
        import torch

        torch.set_num_threads(config.torch_threads)
    asyncio.run(run_until_signalled(lambda: start_role(args.role, config)))
    return 0


def _tiny_model(path: Path, family: str = "qwen2-vl") -> Path:
    from services.models.tiny_model import make_tiny_model

    if not (path / "config.json").exists():
        print(f"building a tiny random {family} model in {path} ...", flush=True)
        make_tiny_model(path, family)
    return path


def _start(args: argparse.Namespace):
    from services.launch.local import ClusterSpec, start_cluster

    model = Path(args.model) if args.model else _tiny_model(DEFAULT_TINY)
    redis_url = os.environ.get("EPD_REDIS_URL", "redis://127.0.0.1:6379/0")
    print(f"starting router, {args.encoders} encoder(s), {args.workers} worker(s) for {model} ...", flush=True)
    return start_cluster(ClusterSpec(model, args.encoders, args.workers, redis_url))


def _up(args: argparse.Namespace) -> int:
    if args.ray:
        from services.launch.ray_launcher import launch_on_ray

        model = Path(args.model) if args.model else _tiny_model(DEFAULT_TINY)
        handle = launch_on_ray(model_dir=model, encoders=args.encoders, workers=args.workers,
                               address=args.address)
        stop = handle.stop
        print(f"epd on Ray: {handle}")
    else:
        cluster = _start(args)
        stop = cluster.stop
        for p in cluster.processes:
            print(f"  {p.role:8s} {p.address}  metrics http://127.0.0.1:{p.metrics_port}/metrics  log {p.log_path}")
        print(f"router (gRPC Generate) at {cluster.address}. Try: epd generate --image FILE \"describe\"")
    print("Ctrl-C stops everything.", flush=True)
    _wait_for_stop_signal()
    stop()
    return 0


def _wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM (both handled, so neither kills us before cleanup)."""
    import threading

    stopped = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopped.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopped.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _demo_image() -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (448, 336), (30, 90, 160))
    draw = ImageDraw.Draw(image)
    draw.ellipse((60, 40, 260, 240), fill=(240, 200, 40))
    draw.rectangle((280, 120, 420, 300), fill=(200, 40, 60))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _print_stream(address: str, request) -> int:
    from services.client import Client

    with Client(address) as client:
        count = client.count(request)
        print(f"tokens: text {count.text_tokens}, image {count.image_tokens}, prompt {count.prompt_tokens}, "
              f"projected {count.projected_tokens}")
        final = None
        for response in client.stream(request):
            if response.HasField("chunk"):
                print(response.chunk.text, end="", flush=True)
            else:
                final = response.final
        usage = final.usage
        print(f"\n[{final.finish_reason}] prompt {usage.prompt_tokens} (text {usage.text_tokens}, image "
              f"{usage.image_tokens}, cached {usage.cached_tokens}), completion {usage.completion_tokens}, "
              f"first token {final.timing.first_token_s * 1000:.0f} ms, total {final.timing.total_s:.2f} s")
    return 0


def _request(args: argparse.Namespace):
    from services.client import user_request

    images = [Path(p).read_bytes() for p in args.image]
    return user_request(args.prompt, images, max_tokens=args.max_tokens, temperature=args.temperature)


def _demo(args: argparse.Namespace) -> int:
    from services.client import user_request

    cluster = _start(args)
    try:
        print(f"cluster up; router at {cluster.address}\nrequest: one 448x336 PNG + \"Describe this image.\"")
        return _print_stream(cluster.address, user_request("Describe this image.", [_demo_image()],
                                                            max_tokens=args.max_tokens))
    finally:
        cluster.stop()
        print("cluster stopped.")


def _count(args: argparse.Namespace) -> int:
    from services.client import Client

    with Client(args.address) as client:
        count = client.count(_request(args))
    print(f"text {count.text_tokens}\nimage {count.image_tokens}\nprompt {count.prompt_tokens}\n"
          f"max_tokens {count.max_tokens}\nprojected {count.projected_tokens}\n"
          f"per item {list(count.tokens_per_item)}")
    return 0


def _health(args: argparse.Namespace) -> int:
    from services.launch.health import check

    ok = check(args.address, args.service)
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


def _make_tiny(args: argparse.Namespace) -> int:
    from services.models.tiny_model import make_tiny_model

    path = make_tiny_model(Path(args.dir), args.family, max_pixels=args.max_pixels)
    print(path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Benchmarks live in the source checkout (tests/bench/); run one there as a module."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    if not (root / "tests" / "bench" / f"bench_{args.what}.py").exists():
        print(f"epd bench needs a source checkout (tests/bench/ next to services/); not found under {root}")
        return 2
    return subprocess.call([sys.executable, "-m", f"tests.bench.bench_{args.what}", *args.rest], cwd=root)


def _parser() -> argparse.ArgumentParser:
    from services.serve import CONFIGS

    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve_roles = serve.add_subparsers(dest="role", required=True)
    for role, cls in CONFIGS.items():
        config_lib.add_arguments(serve_roles.add_parser(role, help=f"the {role}"), cls)
    serve.set_defaults(fn=_serve)
    for name, fn, text in (("up", _up, "start the whole cluster on this box"),
                           ("demo", _demo, "start the cluster, send one image request, stop")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--model", help="model folder (default: a tiny random Qwen2-VL built offline)")
        cmd.add_argument("--encoders", type=int, default=1)
        cmd.add_argument("--workers", type=int, default=1)
        cmd.set_defaults(fn=fn)
        if name == "up":
            cmd.add_argument("--ray", action="store_true", help="run the services as Ray actors")
            cmd.add_argument("--address", help="Ray cluster address (default: start a local one)")
        else:
            cmd.add_argument("--max-tokens", type=int, default=32)
    for name, fn in (("generate", _print_stream_cmd), ("count", _count)):
        cmd = sub.add_parser(name, help=f"{name} through the router")
        cmd.add_argument("prompt")
        cmd.add_argument("--image", action="append", default=[], help="image file (repeatable)")
        cmd.add_argument("--address", default="127.0.0.1:50051")
        cmd.add_argument("--max-tokens", type=int, default=64)
        cmd.add_argument("--temperature", type=float, default=0.0)
        cmd.set_defaults(fn=fn)
    health = sub.add_parser("health", help="exit 0 when a service reports SERVING")
    health.add_argument("address")
    health.add_argument("--service", default="")
    health.set_defaults(fn=_health)
    tiny = sub.add_parser("make-tiny-model", help="build a tiny random model folder offline")
    tiny.add_argument("dir")
    tiny.add_argument("--family", default="qwen2-vl", choices=["qwen2-vl", "qwen2.5-vl"])
    tiny.add_argument("--max-pixels", type=int, default=None)
    tiny.set_defaults(fn=_make_tiny)
    bench = sub.add_parser("bench", help="benchmarks (print ratios against a same-run baseline)")
    bench.add_argument("what", choices=["engine", "encoder", "admission"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(fn=_bench)
    return parser


def _print_stream_cmd(args: argparse.Namespace) -> int:
    return _print_stream(args.address, _request(args))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub at run time
    args = _parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
