"""docs/structure.md lists every module with its docstring's first line (regenerate when stale)."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_structure_doc_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen_structure", ROOT / "scripts" / "gen_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs" / "structure.md").read_text()
    assert current == module.render(), "docs/structure.md is stale: run python scripts/gen_structure.py"
    assert "(no docstring)" not in current, "every module needs a docstring"
