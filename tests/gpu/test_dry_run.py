"""`tests/gpu/run.sh --dry-run`: the GPU check's own code on the CPU, so it cannot rot between GPU loans.

The GPU machines have torch, transformers and numpy only: every section must also run with Pillow, gRPC, Redis
and OpenTelemetry unimportable. One run proves both: run.sh runs each section in a process of its own, and a
``sitecustomize`` on the path makes those modules unimportable in each section's process (the tensor-parallel
section keeps Pillow: its ranks load the model folder as a worker does, and its image processor needs it; on a
machine without it the section says so and is skipped), writing down each section it blocked them in.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("PIL", "grpc", "redis", "opentelemetry")
SECTIONS = ("env", "kernel", "exactness", "structured", "decode", "vision", "tensor_parallel")
SITECUSTOMIZE = f"""
import os, sys

if "--section" in sys.argv:  # a section's process (not run.sh's driver, nor a rank it spawns)
    section = sys.argv[sys.argv.index("--section") + 1]
    blocked = [b for b in {BLOCKED!r} if not (section == "tensor_parallel" and b == "PIL")]
    for name in blocked:
        sys.modules[name] = None  # import fails, as on a GPU machine without them
    with open(os.environ["EPD_DRY_RUN_BLOCKED_LOG"], "a") as log:
        log.write(section + " " + ",".join(blocked) + "\\n")
"""


def _last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def _check(name: str, section: dict) -> None:
    assert "error" not in section, f"{name}: {section}"
    if name == "env":
        assert section["varlen_attn_block_table"] is True and "block_table" in section["aten_flash_schema"]
    if name == "kernel":  # the triton kernel in the interpreter, fp32; torch's flash needs CUDA
        assert section["flash"]["skipped"] and set(section["triton"]) == {
            "mixed_max_abs_diff_fp32",
            "decode_max_abs_diff_fp32",
        }
        assert max(section["triton"].values()) < 1e-5
    if name == "exactness":
        for variant in ("flash_reference_graphs", "auto"):
            result = section[variant]
            assert result["exact"] + result["ties"] == result["requests"] == 16 and result["wrong"] == [], variant
        assert section["flash_reference_graphs"]["graph_steps"] > 0
    if name == "structured":  # xgrammar is installed here (not on the GPU machines: skipped there)
        assert section["plain_rows_unchanged"] == section["constrained_rows"] == section["rows"] // 2
        assert section["constrained_rows_valid"] == section["constrained_rows"] and section["structured_ratio"] > 0
    if name == "tensor_parallel":  # two gloo ranks on the CPU: fp32 tokens equal TP=1's
        assert (
            section["equal"] == section["requests"] > 0
            and section["tp2"]["kv_blocks"] == 2 * section["tp1"]["kv_blocks"]
        )
    if name == "decode":  # one entry per backend, each naming what ran: flash cannot here, the others do
        assert "needs CUDA" in section["flash"]["skipped"]
        assert set(section["generate"]) == {"batch_1", "batch_4", "batch_8"}
        ran = {"triton": (16, "eager"), "flash-reference": (256, "eager"), "sdpa": (16, "off")}
        for backend, (block_size, graphs) in ran.items():
            entry = section[backend]
            assert (entry["backend"], entry["block_size"], entry["graphs"]) == (backend, block_size, graphs)
            assert "fallbacks" not in entry
            for batch in (1, 4, 8):
                figures = entry[f"batch_{batch}"]
                assert figures["engine_tok_s"] > 0 and figures["generate_tok_s"] > 0, (backend, figures)
                assert (figures.get("bare_step_ms", 0) > 0) == (graphs == "eager"), (backend, figures)
    if name == "vision":
        assert section["images_per_s"] > 0 and section["planned"] is True
        assert section["tower_ms"] > 0 and section["staging_ms"] >= 0


def test_run_sh_dry_run_prints_the_json_line_with_each_section_on_torch_and_transformers_only(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "blocked.log"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "EPD_DRY_RUN_BLOCKED_LOG": str(log)}
    done = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh"), "--dry-run"], capture_output=True, text=True,
                          timeout=450, cwd=ROOT, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = _last_json(done.stdout)
    assert report["dry_run"] is True and report["seconds"] > 0  # its time is printed, not judged: a loaded box is slow
    for name in SECTIONS:
        _check(name, report[name])
    assert len(done.stderr.strip().splitlines()) >= len(SECTIONS)  # progress: a line per section as it ends
    blocked = dict(line.split(" ") for line in log.read_text().splitlines())
    assert blocked == {
        name: ",".join(b for b in BLOCKED if not (name == "tensor_parallel" and b == "PIL")) for name in SECTIONS
    }
