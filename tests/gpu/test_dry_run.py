"""`tests/gpu/run.sh --dry-run`: the GPU check's own code on the CPU, so it cannot rot between GPU loans.

The GPU machines have torch, transformers and numpy only: the check must also run with Pillow, gRPC, Redis and
OpenTelemetry unimportable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("PIL", "grpc", "redis", "opentelemetry")


def _report(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def _check(report: dict) -> None:
    assert report["dry_run"] is True
    for name in ("env", "kernel", "exactness", "decode", "vision"):
        assert "error" not in report[name], f"{name}: {report[name]}"
    exact = report["exactness"]
    assert exact["exact"] + exact["ties"] == exact["requests"] == 16 and exact["wrong"] == []
    assert exact["backend"] == "flash-reference" and exact["graph_steps"] > 0
    decode = report["decode"]
    assert decode["backend"] == "flash-reference" and decode["block_size"] == 256 and "fallbacks" not in decode
    for batch in (1, 4, 8):
        figures = decode[f"batch_{batch}"]
        assert figures["engine_tok_s"] > 0 and figures["generate_tok_s"] > 0 and figures["bare_step_ms"] > 0
    assert report["vision"]["images_per_s"] > 0
    assert report["env"]["varlen_attn_block_table"] is True


def test_run_sh_dry_run_prints_the_json_line() -> None:
    done = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh"), "--dry-run"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _check(_report(done.stdout))


def test_dry_run_needs_only_torch_and_transformers() -> None:
    code = (
        "import runpy, sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # import fails, as on a GPU machine without them\n"
        "sys.argv = ['gpu_check', '--dry-run']\n"
        "runpy.run_module('tests.gpu.gpu_check', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    _check(_report(done.stdout))
