"""deploy/docker/Dockerfile, parsed with BuildKit's own parser (the `dockerfile` package)."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import dockerfile
import pytest

from tests.deploy.support import DOCKERFILE, REPO

TORCH_INDEX = "https://download.pytorch.org/whl/"


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
    global_args = [c.value[0] for c in cmds[: next(i for i, c in enumerate(cmds) if c.cmd == "FROM")] if c.cmd == "ARG"]
    assert "VARIANT=cpu" in global_args
    assert ("base-${VARIANT}", "AS", "base") in stages
    assert stages[-1] == ("base", "AS", "runtime")


def torch_pin() -> str:
    """The torch version pyproject.toml pins."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    return pin.split("==")[1]


def expand(text: str, variables: dict[str, str]) -> str:
    """Dockerfile variable substitution (`$VAR`, `${VAR}`); unknown variables become empty."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), ""), text)


def global_arg_defaults() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults."""
    cmds = commands()
    first_from = next(i for i, c in enumerate(cmds) if c.cmd == "FROM")
    return dict(c.value[0].partition("=")[::2] for c in cmds[:first_from] if c.cmd == "ARG")


def stage_variables(stage: str, build_args: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(ENV, ENV and ARG values) of `stage` as BuildKit resolves them with `build_args` (--build-arg):
    the FROM chain followed through this file's stages, ARG defaults, ENV inherited from parents.
    An outside base image contributes nothing (its own ENV is overridden where this file sets one)."""
    cmds = commands()
    global_args = {name: build_args.get(name, default) for name, default in global_arg_defaults().items()}
    starts = {c.value[2]: i for i, c in enumerate(cmds) if c.cmd == "FROM" and len(c.value) == 3}
    start = starts[stage]
    parent = expand(cmds[start].value[0], global_args)
    env = stage_variables(parent, build_args)[0] if parent in starts else {}
    scope = dict(env)
    for cmd in cmds[start + 1 :]:
        if cmd.cmd == "FROM":
            break
        if cmd.cmd == "ARG":
            name, eq, default = cmd.value[0].partition("=")
            scope[name] = build_args.get(name, expand(default, scope) if eq else global_args.get(name, ""))
        elif cmd.cmd == "ENV":
            for name, value in zip(cmd.value[::2], cmd.value[1::2], strict=True):
                env[name] = scope[name] = expand(value, scope)
    return env, scope


def torch_install(variant: str) -> tuple[str, str]:
    """(index URL, requirement) of the builder stage's torch install for `variant`, resolved."""
    _, scope = stage_variables("builder", {"VARIANT": variant})
    run = next(c.value[0] for c in commands() if c.cmd == "RUN" and "--index-url" in c.value[0])
    pip = next(part for part in run.split("&&") if "--index-url" in part)
    words = [expand(w, scope) for w in shlex.split(pip)]
    assert words[:2] == ["pip", "install"], words
    index = words[words.index("--index-url") + 1]
    (requirement,) = [w for w in words[2:] if w.startswith("torch")]
    return index, requirement


def cuda_image_version() -> tuple[int, int]:
    """CUDA major.minor of the default CUDA base image (nvidia/cuda:<major>.<minor>.<patch>-...)."""
    image = global_arg_defaults()["CUDA_IMAGE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[\w.-]*ubuntu24\.04", image)
    assert match, f"CUDA base image {image!r} is not an nvidia/cuda Ubuntu 24.04 image with a full version"
    return int(match.group(1)), int(match.group(2))


def test_torch_comes_from_the_variant_index_at_the_project_pin() -> None:
    major, minor = cuda_image_version()
    assert torch_install("cpu") == (f"{TORCH_INDEX}cpu", f"torch=={torch_pin()}")
    assert torch_install("cuda") == (f"{TORCH_INDEX}cu{major}{minor}", f"torch=={torch_pin()}")
    assert any(c.cmd == "RUN" and 'pip install ".${PACKAGE_EXTRAS}"' in c.value[0] for c in commands())


def test_only_the_cuda_image_installs_the_gpu_extra() -> None:
    """Triton (the `triton` attention backend) is the `gpu` extra: installed in the CUDA image, never in the CPU
    one, and not a dependency of the package itself."""
    run = next(c.value[0] for c in commands() if c.cmd == "RUN" and "pip check" in c.value[0])
    for variant, target in (("cpu", "."), ("cuda", ".[gpu]")):
        scope = stage_variables("builder", {"VARIANT": variant})[1]
        assert [expand(w, scope) for w in shlex.split(run.split("&&")[0])] == ["pip", "install", target]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["gpu"])
    assert not any(d.startswith("triton") for d in project["dependencies"])


def test_cuda_wheel_index_matches_the_cuda_base_image_and_the_docs() -> None:
    major, minor = cuda_image_version()
    assert stage_variables("base-cuda", {})[1]["TORCH_CUDA"] == f"cu{major}{minor}"
    # Both build arguments move together: another CUDA image with its own index resolves to that index.
    other = {"VARIANT": "cuda", "CUDA_IMAGE": "nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04", "TORCH_CUDA": "cu129"}
    assert stage_variables("builder", other)[0]["TORCH_INDEX_URL"] == f"{TORCH_INDEX}cu129"
    deploy_doc = (REPO / "docs" / "deploy.md").read_text()
    assert f"{TORCH_INDEX}cu{major}{minor}" in deploy_doc
    assert f"nvidia/cuda:{major}.{minor}." in deploy_doc
    assert f"torch=={torch_pin()}" in deploy_doc


def torch_check() -> str:
    """The shell command the builder runs after installing torch to check what it got."""
    run = next(c.value[0] for c in commands() if c.cmd == "RUN" and "--index-url" in c.value[0])
    (check,) = [part.strip() for part in run.split("&&") if part.strip().startswith("python -c")]
    return check


@pytest.mark.parametrize("case", ["matching", "other CUDA", "other version"])
def test_the_build_checks_the_torch_it_installed(case: str) -> None:
    """The check runs here against this venv's torch (the pinned version, a CPU or a CUDA build)."""
    import torch

    assert torch.__version__.split("+")[0] == torch_pin()
    # CUDA_VERSION as an nvidia/cuda image of this torch's CUDA would set it; unset for a CPU build.
    cuda = {"CUDA_VERSION": f"{torch.version.cuda}.1"} if torch.version.cuda else {}
    env = {
        "matching": cuda,
        "other CUDA": {"CUDA_VERSION": "11.0.3"},  # a CUDA base image the wheel was not built for
        "other version": {**cuda, "TORCH_VERSION": "2.0.0"},
    }[case]
    run_env = {k: v for k, v in os.environ.items() if k != "CUDA_VERSION"}
    run_env.update(
        {
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "TORCH_VERSION": torch_pin(),
            "TORCH_INDEX_URL": f"{TORCH_INDEX}cpu",
            **env,
        }
    )
    done = subprocess.run(["sh", "-c", torch_check()], env=run_env, capture_output=True, text=True, timeout=120)
    assert (done.returncode == 0) == (case == "matching"), done.stderr
    if case != "matching":
        assert "want torch" in done.stderr and f"{TORCH_INDEX}cpu" in done.stderr


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_image_exposes_no_gpu_unless_the_container_requests_one(variant: str) -> None:
    env = stage_variables("runtime", {"VARIANT": variant})[0]
    if variant == "cuda":
        # CUDA base images set NVIDIA_VISIBLE_DEVICES=all, which the NVIDIA runtime reads as "every GPU":
        # the image says void, and device requests / the device plugin set the devices they assign.
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    else:
        assert "NVIDIA_VISIBLE_DEVICES" not in env
    for cmd in commands():
        if cmd.cmd == "ENV":
            assert dict(zip(cmd.value[::2], cmd.value[1::2], strict=True)).get("NVIDIA_VISIBLE_DEVICES", "void") in {
                "void",
                "",
            }, cmd.original


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
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    kept = []
    for path in sorted(p for p in REPO.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts):
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
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("epd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
    assert {"services/cli.py", "services/common/rpc/epd/v1/generation_pb2.py"} <= members
