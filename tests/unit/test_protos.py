"""The checked-in gRPC stubs are exactly what scripts/gen_protos.py generates from proto/."""

from __future__ import annotations

import filecmp
import importlib.util
import pathlib
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_are_current() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _generator().generate(pathlib.Path(tmp))
        fresh = pathlib.Path(tmp) / "epd" / "v1"
        checked_in = ROOT / "services" / "common" / "rpc" / "epd" / "v1"
        names = sorted(p.name for p in fresh.iterdir() if p.is_file())
        assert names == sorted(p.name for p in checked_in.iterdir() if p.is_file() and p.suffix != ".pyc")
        _, mismatch, errors = filecmp.cmpfiles(fresh, checked_in, names, shallow=False)
        assert not mismatch and not errors, f"stale stubs {mismatch + errors}: run python scripts/gen_protos.py"
