"""Regenerate the gRPC stubs in services/common/rpc from proto/ (the one place stubs come from).

Imports in generated files are rewritten to package-relative form so the stubs work as
`services.common.rpc.epd.v1.*` without touching sys.path.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "services" / "common" / "rpc"


def generate(out_dir: pathlib.Path) -> None:
    """Write stubs for every proto under proto/ into out_dir."""
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out_dir.rglob("*.py*"):
        text = path.read_text()
        text = re.sub(r"^from epd\.v1 import", "from services.common.rpc.epd.v1 import", text, flags=re.M)
        path.write_text(text)
    for pkg in [out_dir / "epd", out_dir / "epd" / "v1"]:
        (pkg / "__init__.py").touch()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        target = OUT_DIR / "epd"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(pathlib.Path(tmp) / "epd", target)
    (OUT_DIR / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
