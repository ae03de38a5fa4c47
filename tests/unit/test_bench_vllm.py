"""`epd bench vllm` without vLLM: vLLM's result JSON read into our names, the ratios, the targets, the table,
the client's flags, the venv workarounds on a laid-out site-packages, the shared model folder, and vLLM
told apart from another server on its port."""

from __future__ import annotations

import ast
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.bench import vllm_venv
from tests.bench.bench_vllm import model_folder, parse_args, tree_cpu_s, vllm_client_args, wait_for_vllm
from tests.bench.vllm_report import acceptance, acceptance_lines, client_figures, cpu_lines, ratios, table


def vllm_result(tok_s: float, ttft_p99: float, itl_p99: float, failed: int = 0) -> dict:
    """A result as vLLM 0.32's client writes it with --metric-percentiles 50,99 --save-detailed (the keys read)."""
    return {
        "num_prompts": 64,
        "completed": 64 - failed,
        "failed": failed,
        "errors": [""] * (64 - failed) + ["HTTP 429: busy"] * failed,
        "duration": 4.0,
        "total_output_tokens": 4096,
        "output_throughput": tok_s,
        "median_ttft_ms": ttft_p99 / 2,
        "p50_ttft_ms": ttft_p99 / 2,
        "p99_ttft_ms": ttft_p99,
        "median_itl_ms": itl_p99 / 4,
        "p50_itl_ms": itl_p99 / 4,
        "p99_itl_ms": itl_p99,
        "p50_tpot_ms": 9.0,
        "p99_tpot_ms": 20.0,
    }


def test_client_figures_take_vllms_names_into_ours() -> None:
    got = client_figures(vllm_result(800.0, 300.0, 40.0, failed=2))
    assert got["requests"] == 64 and got["completed"] == 62 and got["failed"] == 2
    assert got["errors"] == ["HTTP 429: busy"]
    assert got["tokens_per_s"] == 800.0 and got["output_tokens"] == 4096 and got["wall_s"] == 4.0
    assert (got["ttft_p50_ms"], got["ttft_p99_ms"]) == (150.0, 300.0)
    assert (got["itl_p50_ms"], got["itl_p99_ms"]) == (10.0, 40.0)
    assert (got["tpot_p50_ms"], got["tpot_p99_ms"]) == (9.0, 20.0)


def test_ratios_are_epd_over_vllm_and_none_without_both_sides() -> None:
    epd = {"text": client_figures(vllm_result(1300.0, 150.0, 10.0)), "fresh-image": {"tokens_per_s": 500.0}}
    vllm = {"text": client_figures(vllm_result(1000.0, 300.0, 40.0)), "fresh-image": {"tokens_per_s": 0.0}}
    got = ratios(epd, vllm)
    assert got["text"]["tokens_per_s"] == pytest.approx(1.3)
    assert got["text"]["ttft_p99_ms"] == pytest.approx(0.5) and got["text"]["itl_p99_ms"] == pytest.approx(0.25)
    assert got["fresh-image"]["tokens_per_s"] is None  # vLLM's 0: no ratio
    assert got["fresh-image"]["ttft_p99_ms"] is None


def test_acceptance_checks_each_target_at_its_bound() -> None:
    by_client = {
        "vllm": {
            "text": {"tokens_per_s": 1.3},  # at the bound: met
            "fresh-image": {"tokens_per_s": 1.19, "ttft_p99_ms": 1.0, "itl_p99_ms": 0.4},
            "repeated-image": {"tokens_per_s": 2.5, "itl_p99_ms": None},
        }
    }
    rows = {(r["workload"], r["figure"]): r for r in acceptance(by_client)}
    assert len(rows) == 6
    assert rows[("text", "tokens_per_s")]["met"] is True
    assert rows[("fresh-image", "tokens_per_s")]["met"] is False
    assert rows[("fresh-image", "ttft_p99_ms")]["met"] is True  # no worse than vLLM's
    assert rows[("fresh-image", "itl_p99_ms")]["met"] is False  # above a third
    assert rows[("repeated-image", "tokens_per_s")]["met"] is True
    assert rows[("repeated-image", "itl_p99_ms")]["met"] is None
    lines = acceptance_lines(acceptance(by_client))
    assert any("fresh-image" in line and "NOT met" in line for line in lines)
    assert any("no figure" in line for line in lines)


def test_table_puts_both_servers_and_the_ratio_on_one_row() -> None:
    results = {
        "vllm": {
            "epd": {"text": client_figures(vllm_result(1300.0, 150.0, 10.0))},
            "vllm": {"text": client_figures(vllm_result(1000.0, 300.0, 40.0))},
        }
    }
    header, row = table(results).splitlines()
    assert "tok/s epd" in header and "TTFT p99 epd" in header and "ITL p99 epd" in header
    assert row.split() == ["vllm", "text", "64/64", "64/64", "1300.0", "1000.0", "1.30"] + [
        "150.0", "300.0", "0.50", "10.00", "40.00", "0.25",
    ]  # fmt: skip


def test_cpu_lines_give_each_servers_cpu_per_output_token_and_the_ratio() -> None:
    ours, theirs = client_figures(vllm_result(1300.0, 150.0, 10.0)), client_figures(vllm_result(1000.0, 300.0, 40.0))
    tokens = ours["output_tokens"]
    ours["server_cpu_s"], theirs["server_cpu_s"] = 0.5e-3 * tokens, 1e-3 * tokens  # 0.5 and 1 ms a token
    results = {"vllm": {"epd": {"text": ours, "fresh-image": {}}, "vllm": {"text": theirs}}}
    [line] = cpu_lines(results)  # a workload without figures on either side prints nothing
    assert line.split()[:2] == ["vllm", "text"]
    assert "epd 0.500, vLLM 1.000 (ratio 0.50)" in line
    del theirs["server_cpu_s"]
    assert "vLLM - (ratio -)" in cpu_lines(results)[0]


def test_a_process_trees_cpu_counts_its_children() -> None:
    """What `server_cpu_s` rests on: a parent that only waits and a child that computes read as the child's CPU."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(30)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_s([parent.pid]) < 0.5:
            assert time.monotonic() < deadline, "the child's CPU was not counted"
            time.sleep(0.1)
    finally:
        import psutil

        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
    assert tree_cpu_s([parent.pid]) == 0.0  # gone: nothing to count


def test_vllm_client_flags_per_workload() -> None:
    args = parse_args(["--image-size", "448x320", "--prompt-tokens", "200", "--max-tokens", "32"])
    text = vllm_client_args(args, "text", "http://127.0.0.1:1", "m", Path("/models/m"))
    image = vllm_client_args(args, "fresh-image", "http://127.0.0.1:1", "m", Path("/models/m"))

    def flag(flags: list[str], name: str) -> str:
        return flags[flags.index(name) + 1]

    for flags in (text, image):
        assert flag(flags, "--backend") == "openai-chat" and flag(flags, "--endpoint") == "/v1/chat/completions"
        assert "--ignore-eos" in flags and flag(flags, "--num-warmups") == "0"
        assert flag(flags, "--random-output-len") == "32" and flag(flags, "--max-concurrency") == "16"
        assert flag(flags, "--tokenizer") == "/models/m" and flag(flags, "--metric-percentiles") == "50,99"
    assert flag(text, "--dataset-name") == "random" and flag(text, "--random-input-len") == "200"
    assert flag(image, "--dataset-name") == "random-mm"
    assert ast.literal_eval(flag(image, "--random-mm-bucket-config")) == {(320, 448, 1): 1.0}  # (height, width)
    assert json.loads(flag(image, "--random-mm-limit-mm-per-prompt")) == {"image": 1, "video": 0}


def test_parse_args_refuses_repeated_images_without_fresh_ones() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "text,repeated-image"])


def test_servers_are_both_or_epd_alone() -> None:
    assert parse_args([]).servers == ["epd", "vllm"]
    assert parse_args(["--servers", "epd", "--clients", "vllm"]).servers == ["epd"]
    for wrong in ("vllm", "epd,sglang"):
        with pytest.raises(SystemExit):
            parse_args(["--servers", wrong])


def test_vllm_server_takes_its_default_dtype_unless_one_is_named(tmp_path: Path) -> None:
    """`--vllm-dtype auto` (the default) leaves vLLM's own choice; float32 / bfloat16 become its `--dtype`."""
    assert parse_args([]).vllm_dtype == "auto"
    default = vllm_venv.server_command(tmp_path, tmp_path / "model", 8123)
    assert "--dtype" not in default and default[-2:] == ["--port", "8123"]
    named = vllm_venv.server_command(
        tmp_path, tmp_path / "model", 8123, parse_args(["--vllm-dtype", "float32"]).vllm_dtype
    )
    assert named[-2:] == ["--dtype", "float32"] and named[:-2] == default
    with pytest.raises(SystemExit):
        parse_args(["--vllm-dtype", "float64"])


META = """import functools

import torch
import torch.library

import torchvision.extension  # noqa: F401


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
"""


def test_workarounds_remove_the_c_extensions_and_guard_the_fake_registrations(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    for name in ("torchvision/_C.so", "torchvision/image.so", "torchaudio/lib/_torchaudio.so", "torchcodec/libx.so"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(b"\x7fELF")
    (site / "torchvision" / "io.py").write_text("# kept\n")
    (site / "torchvision" / "_meta_registrations.py").write_text(META)
    done = vllm_venv.apply_workarounds(tmp_path)
    assert sorted(p.name for p in site.rglob("*.so")) == []
    assert (site / "torchvision" / "io.py").is_file()
    assert len(done) == 5 and done[-1].startswith("guarded")
    patched = (site / "torchvision" / "_meta_registrations.py").read_text()
    assert "@torch.library.register_fake(" not in patched
    assert patched.count('@_fake_if_ops("torchvision::') == 2
    compile(patched, "_meta_registrations.py", "exec")
    assert patched.index("def _fake_if_ops") < patched.index("@_fake_if_ops")
    assert vllm_venv.apply_workarounds(tmp_path) == []  # idempotent


def test_the_shared_folder_fits_vllms_cpu_attention_and_has_no_video_processor_file(tmp_path: Path) -> None:
    from services.models.loading import read_video_processor_dict

    folder = model_folder(tmp_path / "model", 256, 2)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] >= 32  # vLLM's CPU attention: head sizes 32 and up
    assert not (folder / "video_preprocessor_config.json").exists()
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert "do_sample_frames" not in read_video_processor_dict(folder)  # the image processor's file instead


def test_a_bfloat16_folder_holds_and_declares_bfloat16(tmp_path: Path) -> None:
    """`--folder-dtype bfloat16`: every floating-point weight stored in bfloat16 and the dtype declared where the
    config declares one, so both servers' defaults (vLLM's auto, epd's `EPD_DTYPE=auto`) compute in it."""
    from safetensors import safe_open

    from services.models.loading import read_folder_dtype

    folder = model_folder(tmp_path / "model", 256, 2, "bfloat16")
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118 (not a dict)
    assert dtypes == {"BF16"}
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == "bfloat16"
    assert read_folder_dtype(folder) == "bfloat16"


class _Models(http.server.BaseHTTPRequestHandler):
    model = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"data": [{"id": self.model}]}).encode() if self.path == "/v1/models" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("listed", ["/models/m", "model"])
def test_vllm_is_waited_for_by_the_model_it_lists_not_by_whoever_answers_the_port(tmp_path: Path, listed: str) -> None:
    """A server on the port that answers /health but names another model (epd's HTTP API took the port) is not
    taken for vLLM."""
    handler = type("Handler", (_Models,), {"model": listed})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = tmp_path / "vllm.log"
    log.write_text("starting\n")
    try:
        if listed == "/models/m":
            wait_for_vllm(alive, server.server_address[1], "/models/m", log, timeout_s=30.0)
        else:
            with pytest.raises(RuntimeError, match="not ready"):
                wait_for_vllm(alive, server.server_address[1], "/models/m", log, timeout_s=3.0)
    finally:
        alive.kill()
        alive.wait()
        server.shutdown()
        server.server_close()
