"""Services meet over gRPC only: the router, encoder and worker import none of each other's modules, only the
shared layers below them (services/common over services/models), with no cycle; and a media item's place in a
prompt has one type in services/ (`MediaSpan`), the proto's `MediaRef` aside."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"
ALLOWED = {
    "models": set(),
    "common": {"models"},
    "router": {"common", "models"},
    "encoder": {"common", "models"},
    "worker": {"common", "models"},
}
"""What each package may import from the other packages of services/: a service only the shared layers."""


def _modules() -> list[tuple[Path, ast.Module]]:
    return [
        (path, ast.parse(path.read_text(), str(path)))
        for path in sorted(SERVICES.rglob("*.py"))
        if "rpc" not in path.relative_to(SERVICES).parts  # generated stubs
    ]


def _imported_packages(tree: ast.Module) -> set[str]:
    """The services/ packages a module imports from, at any depth (function-level imports count too)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return {name.split(".")[1] for name in names if name.startswith("services.")}


def test_each_service_imports_only_the_shared_layers() -> None:
    found: dict[str, set[str]] = {package: set() for package in ALLOWED}
    for path, tree in _modules():
        package = path.relative_to(SERVICES).parts[0]
        if package in ALLOWED:
            found[package] |= _imported_packages(tree) - {package}
    beyond = {package: found[package] - ALLOWED[package] for package in ALLOWED}
    assert beyond == {package: set() for package in ALLOWED}


def test_the_allowed_layers_have_no_cycle() -> None:
    order: list[str] = []
    pending = dict(ALLOWED)
    while pending:
        ready = [package for package, deps in pending.items() if deps <= set(order)]
        assert ready, f"import cycle among {sorted(pending)}"
        order.extend(sorted(ready))
        for package in ready:
            del pending[package]
    assert order.index("models") < order.index("common") < order.index("router")


def test_one_media_span_type() -> None:
    """A class with an ``offset`` and a token count (``num_tokens`` or ``length``) is a media span: one exists."""
    spans = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and hasattr(s.target, "id")}
                if "offset" in fields and fields & {"num_tokens", "length"}:
                    spans.append(f"{path.relative_to(SERVICES)}:{node.name}")
    assert spans == ["models/media_span.py:MediaSpan"]
