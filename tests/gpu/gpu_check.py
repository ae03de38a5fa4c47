"""The GPU check: what a borrowed GPU machine runs as it is (`tests/gpu/run.sh`), printing one JSON line.

Models are built in memory from configs with random weights (no downloads, no tokenizer): prompts are token
ids, images are random pixel patches. Each section runs in a process of its own (a fresh CUDA context and
all its memory back afterwards), under its own time limit inside a budget for the whole run; its figures
are reported even when another section fails, hangs or crashes the process:

- ``env``: torch / transformers versions, the device, whether torch's ``varlen_attn`` takes a ``block_table``.
- ``kernel``: each paged kernel that runs (torch's FlashAttention call, our Triton kernel) against the
  pure-torch twin on a random paged pool (bf16 on CUDA).
- ``exactness``: 16 concurrent mixed requests (text, 1-3 images) on a small Qwen2-VL in fp32 through the
  engine against ``generate`` alone, ties aside: the flash path's twin and the triton backend with captured
  decode graphs, and ``auto``; each kernel's bf16 tokens against the twin's.
- ``structured``: the engine's grammar step on the device (tests/gpu/structured.py): a JSON schema on half of
  32 greedy requests leaves the other rows' tokens unchanged and every constrained output valid; decode step time
  with the schema on every request against none (``structured_ratio``), host syncs per constrained step.
- ``decode``: bf16 decode throughput and inter-token latency against ``generate`` with static batches at 1, 32
  and 128 sequences on a Qwen2-VL-7B-shaped model, for each backend in turn (``triton``, ``flash`` where torch
  has it, ``sdpa`` as the baseline; decode graphs where the backend takes them), each under its own name: the
  engine's decode step against its own graph replayed alone (the overhead ratio), the KV blocks from memory,
  host syncs per step and staging waits.
- ``tensor_parallel`` (tests/gpu/tensor_parallel.py, last: the budget may leave it out of a whole run; run it
  alone with ``--section tensor_parallel``): on 2 or more GPUs a TP=2 engine (NCCL, bf16) against TP=1 on one
  random model folder: tokens of 32 greedy requests agree except at ties, the median decode step at 32
  sequences of each (``step_ratio``); skipped, saying so, on one GPU.
- ``vision``: vision-tower images/s for 1344x1008 images on the 7B's vision config, the tower timed alone
  (inputs staged first, CUDA events), the staging apart.

Progress goes to stderr, one line per section; the last line on stdout is the whole report. ``--dry-run``
runs the same code on the CPU with tiny shapes (CI runs it, so the script cannot rot), two sections at a time
(nothing in it is timed against a bound; on a GPU they run one after another).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import json
import subprocess
import sys
import time
import traceback
from typing import Any

SECTION_SECONDS = {
    "env": 90,
    "kernel": 90,
    "exactness": 150,
    "structured": 90,
    "decode": 330,
    "vision": 150,
    "tensor_parallel": 150,
}
BUDGET_S = 470
"""The whole run's limit (the GPU loan gives one call of at most 10 minutes; this leaves room)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    parser.add_argument("--section", choices=list(SECTION_SECONDS), help="run one section in this process")
    parser.add_argument("--timeout", type=float, default=0, help="with --section: dump stacks this close to it")
    args = parser.parse_args()
    if args.section:
        print(json.dumps(run_section(args.section, args.dry_run, args.timeout), sort_keys=True), flush=True)
        return
    started = time.perf_counter()
    report: dict[str, Any] = {"dry_run": args.dry_run}
    # on a GPU one section at a time (each times its device alone); a dry run judges no time, so its sections,
    # mostly a fresh interpreter's imports, run two at a time
    with concurrent.futures.ThreadPoolExecutor(2 if args.dry_run else 1) as pool:
        runs = {
            name: pool.submit(_run_in_budget, name, args.dry_run, limit, started)
            for name, limit in SECTION_SECONDS.items()
        }
        for name, run in runs.items():
            report[name] = run.result()
            print(json.dumps({name: report[name]}, sort_keys=True), file=sys.stderr, flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, sort_keys=True), flush=True)


def run_section(name: str, dry_run: bool, timeout: float) -> dict[str, Any]:
    """One section in this process; whatever it measured before an exception is kept."""
    import torch

    from tests.gpu.sections import DRY, GPU, SECTIONS

    if timeout > 10:
        faulthandler.dump_traceback_later(timeout - 5, exit=False)  # a hang shows where, before the kill
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        SECTIONS[name](DRY if dry_run else GPU, out)
    except Exception as exc:  # report what was measured, and why the rest was not
        out["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        out["trace"] = traceback.format_exc(limit=8)[-2000:]
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def _run_in_budget(name: str, dry_run: bool, limit: float, started: float) -> dict[str, Any]:
    """The section's child, given what is left of the run's budget when it starts (at most its own limit)."""
    remaining = BUDGET_S - (time.perf_counter() - started)
    if remaining < 20:
        return {"error": "not run: the run's time budget is spent"}
    return _run_child(name, dry_run, min(limit, remaining))


def _run_child(name: str, dry_run: bool, timeout: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.gpu.gpu_check", "--section", name, "--timeout", str(int(timeout))]
    if dry_run:
        command.append("--dry-run")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {timeout:.0f} s", "stderr": _tail(exc.stderr)}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"the section's process exited with {done.returncode}", "stderr": _tail(done.stderr)}
    return json.loads(lines[-1])


def _tail(text: str | bytes | None, size: int = 2500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-size:]


if __name__ == "__main__":
    main()
