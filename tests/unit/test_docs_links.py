"""The repository's docs stand alone: nothing points outside it, and every docs/*.md they name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "charts/epd/README.md"]


def test_no_doc_points_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text and "DESIGN.md" not in text, doc.name


def test_named_docs_exist() -> None:
    for doc in DOCS:
        for name in re.findall(r"docs/[\w-]+\.md", doc.read_text(encoding="utf-8")):
            assert (ROOT / name).is_file(), f"{doc.relative_to(ROOT)} names {name}, which does not exist"
