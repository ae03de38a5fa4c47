"""Write docs/structure.md: one line per module, the first sentence of each module's docstring.

`python scripts/gen_structure.py` regenerates it; a test fails when it is stale, so the map of
the code stays current without hand edits. Generated stubs under services/common/rpc are summarised
in one line.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "structure.md"
SECTIONS = ["services", "tests", "scripts"]
HEADER = """# Structure

One line per module (generated from the module docstrings by `python scripts/gen_structure.py`).
Protos live in `proto/epd/v1/`; their generated stubs in `services/common/rpc/` (`scripts/gen_protos.py`).
Deployment: `deploy/`, `docker-compose.yml`, `charts/epd/` (see docs/deploy.md).
"""


# Abbreviations whose period does not end a sentence.
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")
SENTENCE_END = re.compile(r"[.!?][)\"'`]*(?=\s|$)")


def first_sentence(doc: str) -> str:
    """The docstring's first sentence: its first paragraph's lines joined, cut after the first `. `."""
    paragraph = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    for match in SENTENCE_END.finditer(paragraph):
        if not paragraph[: match.start() + 1].lower().endswith(ABBREVIATIONS):
            return paragraph[: match.end()]
    return paragraph


def summary(path: pathlib.Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        return "(no docstring)"
    return first_sentence(doc)


def render() -> str:
    lines = [HEADER]
    for section in SECTIONS:
        lines.append(f"\n## {section}/\n")
        for path in sorted((ROOT / section).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "rpc" in rel.parts or (path.name == "__init__.py" and not path.read_text().strip()):
                continue
            lines.append(f"- `{rel}`: {summary(path)}")
    return "\n".join(lines) + "\n"


def main() -> int:
    TARGET.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
