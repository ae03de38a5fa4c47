"""`epd profile` and `epd plan`: measure this machine's costs for a model; plan a traffic mix from them.

`epd profile [--model DIR] [--out FILE] [--quick] [sizes]` runs services/capacity/measure.py and writes the
profile JSON. `epd plan --model DIR --traffic FILE [--profile FILE] [--plots DIR] [--json]` prints the plan
(services/capacity/plan.py) as a table, or as one JSON object with `--json`; it reads the folder's config,
tokenizer and processor settings only, never weights. Bad flags, files and values are one-line usage errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.cli_errors import failure, usage_error

DEFAULT_PROFILE = Path("epd-profile.json")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add `profile` and `plan` to the `epd` command's subcommands."""
    profile = sub.add_parser("profile", help="measure this machine's costs for a model; write a profile JSON")
    profile.add_argument("--model", metavar="DIR", help="model folder (default: a tiny random Qwen2-VL built offline)")
    profile.add_argument(
        "--out", metavar="FILE", type=Path, default=DEFAULT_PROFILE, help=f"where to write (default {DEFAULT_PROFILE})"
    )
    profile.add_argument("--quick", action="store_true", help="the smallest sizes, once each (a smoke run)")
    profile.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to measure (default cpu)")
    profile.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help=_DTYPE_HELP)
    profile.add_argument("--threads", type=_whole(0), default=0, help="torch threads (0: what a service gets)")
    profile.add_argument("--image-sides", type=_sizes(int), metavar="W,W,..", help="widths of 4:3 test images")
    profile.add_argument("--prefill-tokens", type=_sizes(int), metavar="N,N,..", help="prompt lengths")
    profile.add_argument("--decode-batches", type=_sizes(int), metavar="B,B,..", help="decode batch sizes")
    profile.add_argument("--decode-contexts", type=_sizes(int), metavar="C,C,..", help="decode context lengths")
    profile.add_argument("--transfer-mb", type=_sizes(float), metavar="MB,MB,..", help="embedding sizes moved")
    profile.add_argument("--repeats", type=_whole(1), default=None, help="timed runs per size (median kept)")
    profile.add_argument("--probe-repeats", type=_whole(1), default=None, help="probe requests per kind")
    profile.add_argument(
        "--startup-timeout", type=float, default=180.0, metavar="SECONDS", help="wait for the probe cluster"
    )
    profile.set_defaults(fn=run_profile)
    plan = sub.add_parser("plan", help="plan a traffic mix: sizes from the model's config, times from a profile")
    plan.add_argument("--model", metavar="DIR", required=True, help="model folder (config, tokenizer, processor)")
    plan.add_argument("--traffic", metavar="FILE", type=Path, required=True, help="traffic description (YAML)")
    plan.add_argument("--profile", metavar="FILE", type=Path, help="profile from `epd profile` (needed for times)")
    plan.add_argument("--plots", metavar="DIR", type=Path, help="write the cost model's three PNG plots here")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help=_DTYPE_HELP)
    plan.add_argument(
        "--transport", default="grpc", choices=["grpc", "gloo"], help="how embeddings reach workers (default grpc)"
    )
    plan.add_argument(
        "--device-memory-gb",
        type=_sizes(float),
        metavar="GB,GB,..",
        help="also size tensor parallelism: weights and KV per rank, and the smallest size that fits each device",
    )
    plan.add_argument(
        "--kv-tokens", type=_whole(1), default=131072, help="KV a worker must hold, in tokens (default 131072)"
    )
    plan.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of each device for weights and KV, as EPD_GPU_MEMORY_UTILIZATION (default 0.9)",
    )
    plan.set_defaults(fn=run_plan)


_DTYPE_HELP = "KV, embedding and compute dtype (default: the profile's, else the config's, else bfloat16)"


def run_profile(args: argparse.Namespace) -> int:
    """`epd profile`: measure, fit, write the JSON, print a summary line per curve."""
    from dataclasses import replace

    from services.capacity.fit import FitError
    from services.capacity.measure import measure_profile
    from services.capacity.profile import save_profile
    from services.capacity.profile_options import QUICK, ProfileOptions
    from services.launch.preflight import check_device, check_model, resolve_device

    device = resolve_device(args.device)
    check_device(device)
    if args.model:
        check_model(Path(args.model))
        model_dir = Path(args.model)
    else:
        from services.cli_up import DEFAULT_TINY, tiny_model

        model_dir = tiny_model(DEFAULT_TINY)
    options = QUICK if args.quick else ProfileOptions()
    changes: dict[str, Any] = {
        "device": device,
        "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        "threads": args.threads,
        "startup_timeout_s": args.startup_timeout,
    }
    for flag, field in (
        ("image_sides", "image_sides"),
        ("prefill_tokens", "prefill_tokens"),
        ("decode_batches", "decode_batches"),
        ("decode_contexts", "decode_contexts"),
        ("transfer_mb", "transfer_megabytes"),
        ("repeats", "repeats"),
        ("probe_repeats", "probe_repeats"),
    ):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    options = replace(options, **changes)
    if options.problems():
        raise usage_error("; ".join(options.problems()), "pass more sizes (see `epd profile --help`)")
    print(f"profiling {model_dir} on {device} in {options.dtype} (this takes a minute or two) ...", flush=True)
    try:
        profile = measure_profile(model_dir, options, log=lambda line: print(line, flush=True))
    except FitError as exc:
        raise failure(f"the sizes measured do not fit the curves: {exc}", "pass sizes of distinct tokens") from None
    except RuntimeError as exc:  # redis-server missing, or the probe cluster did not start
        raise failure(f"profiling failed: {exc}", "see the message; the probe cluster needs redis-server") from None
    save_profile(profile, args.out)
    rates = ", ".join(
        f"{name} {mb:.0f} MB/s" for name, mb in profile.to_json()["megabytes_per_s"].items() if mb is not None
    )
    tower, prefill = profile.tower.coefficient, profile.prefill.coefficient
    print(
        f"tower {1e6 * tower('tokens'):.1f} us per image token + {1e9 * tower('tokens*tokens'):.2f} ns/token^2; "
        f"prefill {1e6 * prefill('tokens'):.1f} us/token + {1e9 * prefill('tokens*tokens'):.2f} ns/token^2; decode "
        f"step {1000 * profile.decode(batch=1, context=512):.2f} ms at batch 1, context 512; {rates}"
    )
    print(f"profile written to {args.out} ({profile.measured_s:.0f} s)")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """`epd plan`: the table (or `--json`), and the plots with `--plots`."""
    from services.capacity.model_sizes import load_sizes
    from services.capacity.plan import make_plan, plan_json
    from services.capacity.plan_table import plan_table
    from services.capacity.profile import ProfileError, load_profile
    from services.capacity.tp_fit import fits_table
    from services.capacity.traffic import TrafficError, load_traffic
    from services.launch.preflight import check_model

    check_model(Path(args.model))
    try:
        traffic = load_traffic(args.traffic)
    except TrafficError as exc:
        raise usage_error(str(exc), "see docs/planning.md for the traffic format") from None
    profile = None
    if args.profile is not None:
        try:
            profile = load_profile(args.profile)
        except ProfileError as exc:
            raise usage_error(str(exc), "pass a file written by `epd profile`") from None
    if args.plots is not None and profile is None:
        raise usage_error("--plots draws times, which need a profile", "add --profile FILE (from `epd profile`)")
    try:
        sizes = load_sizes(Path(args.model), args.dtype or (profile.dtype if profile else None))
    except (OSError, ValueError) as exc:
        raise failure(
            f"cannot read model folder {args.model}: {exc}", "pass a folder with config, tokenizer and processor files"
        ) from None
    try:
        plan = make_plan(sizes, traffic, profile, args.transport)
    except TrafficError as exc:
        raise usage_error(f"traffic file {args.traffic}: {exc}", "see docs/planning.md") from None
    report = plan_json(plan)
    if args.device_memory_gb:
        report["tensor_parallel"] = tensor_parallel_report(Path(args.model), sizes.dtype_bytes, args)
    if args.plots is not None:
        from services.capacity.plots import draw_plots

        report["plots"] = [str(p.path) for p in draw_plots(plan, args.plots)]
    if args.json:
        print(json.dumps(report))
    else:
        print(plan_table(report))
        for device in report.get("tensor_parallel", []):
            print("\n".join(fits_table(device)))
        for path in report.get("plots", []):
            print(f"plot: {path}")
    return 0


def tensor_parallel_report(model_dir: Path, dtype_bytes: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`epd plan --device-memory-gb`'s part of the report: one entry per device size."""
    from transformers import AutoConfig

    from services.capacity.tp_fit import fits_json, rank_fits, weightless_model

    if not 0 < args.gpu_memory_utilization <= 1:
        raise usage_error("--gpu-memory-utilization must be within (0, 1]", "pass a share such as 0.9")
    model = weightless_model(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    return [
        fits_json(gb, args.kv_tokens, rank_fits(model, dtype_bytes, gb, args.kv_tokens, args.gpu_memory_utilization))
        for gb in args.device_memory_gb
    ]


def _whole(lowest: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{text} is not a whole number >= {lowest}")
        return value

    return parse


def _sizes(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r} needs one or more numbers above 0")
        return values

    return parse
