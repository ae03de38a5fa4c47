"""deploy/docker/Dockerfile, parsed with BuildKit's own parser (the `dockerfile` package)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import dockerfile

from tests.deploy.support import DOCKERFILE, REPO


def commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def final_stage() -> list[dockerfile.Command]:
    cmds = commands()
    last_from = max(i for i, c in enumerate(cmds) if c.cmd == "FROM")
    return cmds[last_from:]


def test_multi_stage_with_variant_argument() -> None:
    cmds = commands()
    stages = [c.value for c in cmds if c.cmd == "FROM"]
    names = {v[2] for v in stages if len(v) == 3}
    assert {"base-cpu", "base-cuda", "builder", "runtime"} <= names
    global_args = [c.value[0] for c in cmds[: next(i for i, c in enumerate(cmds) if c.cmd == "FROM")]
                   if c.cmd == "ARG"]
    assert "VARIANT=cpu" in global_args
    assert ("base-${VARIANT}", "AS", "base") in stages
    assert stages[-1] == ("base", "AS", "runtime")


def test_torch_comes_from_the_variant_index_at_the_project_pin() -> None:
    text = DOCKERFILE.read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    version = pin.split("==")[1]
    assert f"ARG TORCH_VERSION={version}" in text
    assert re.search(r"--index-url \"\$\{TORCH_INDEX_URL\}\" \"torch==\$\{TORCH_VERSION\}\"", text)
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA}" in text
    assert any(c.cmd == "RUN" and "pip install ." in c.value[0] for c in commands())


def test_runtime_is_non_root_with_epd_entrypoint() -> None:
    stage = final_stage()
    users = [c.value[0] for c in stage if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert users[-1].split(":")[0].isdigit()
    entrypoint = next(c for c in stage if c.cmd == "ENTRYPOINT")
    cmd = next(c for c in stage if c.cmd == "CMD")
    assert entrypoint.json and entrypoint.value[-1] == "epd"
    assert cmd.json and cmd.value == ("serve", "router")
    copies = [c for c in stage if c.cmd == "COPY"]
    assert all("--from=builder" in c.flags for c in copies)
    exposed = {p for c in stage if c.cmd == "EXPOSE" for p in c.value}
    assert {"50051", "8000", "50061", "50071", "9400"} <= exposed


def test_build_context_sources_exist_and_dockerignore_keeps_them() -> None:
    for cmd in commands():
        if cmd.cmd == "COPY" and not cmd.flags:
            for source in cmd.value[:-1]:
                if "*" not in source:
                    assert (REPO / source).exists(), source
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[1] == "**" or "**" in ignore
    for kept in ("!pyproject.toml", "!proto/**", "!services/**"):
        assert kept in ignore


def context_files() -> list[Path]:
    """The files `docker build .` sends, by .dockerignore's rules (last matching pattern wins)."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    kept = []
    for path in sorted(p for p in REPO.rglob("*") if p.is_file() and ".venv" not in p.parts
                       and ".git" not in p.parts):
        rel = path.relative_to(REPO).as_posix()
        include = True
        for pattern in patterns:
            negated = pattern.startswith("!")
            glob = pattern.lstrip("!").replace("**/", "*").replace("/**", "/*").replace("**", "*")
            if fnmatch.fnmatch(rel, glob):
                include = negated
        if include:
            kept.append(path)
    return kept


def test_package_builds_from_the_docker_context(tmp_path: Path) -> None:
    files = context_files()
    names = {p.relative_to(REPO).as_posix() for p in files}
    assert "pyproject.toml" in names and "services/cli.py" in names
    assert not any(n.startswith(("tests/", "charts/", ".venv/")) or n.endswith(".pyc") for n in names)
    context = tmp_path / "context"
    for path in files:
        target = context / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(context)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("epd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
    assert {"services/cli.py", "services/common/rpc/epd/v1/generation_pb2.py"} <= members
