"""The docs read on their own: no issue or acceptance numbers, no "planned" for what is built, no missing docs.

A reader of the repository cannot resolve an issue tracker's numbers; the docs name what is proven
instead. What is not built yet is listed under architecture.md's "Not built yet", and nothing else is
called planned as a status.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Every text that may name a doc: the docs themselves and the code's docstrings and comments.
NAMERS = [*DOCS, *sorted((ROOT / "services").rglob("*.py")), *sorted((ROOT / "scripts").rglob("*.py"))]

TRACKER_NUMBER = re.compile(r"\b(issue|acceptance)\s+#?\d+", re.IGNORECASE)
# "planned" as a status ("## Planned", "Planned: ...", "(planned)", "X is planned"), not as in "planned frames".
PLANNED_STATUS = re.compile(r"^#+\s*planned\b|^\s*[-*]?\s*planned:|\(planned\)|\b(is|are) planned\s*([.;,)]|$)", re.I)
# Built things, each proven by its module, that must not appear under "Not built yet".
BUILT = {
    "trace": ROOT / "services/common/tracing.py",
    "inter-token latency target": ROOT / "services/worker/engine/itl_target.py",
    "video for qwen2-vl": ROOT / "services/models/qwen2_vl_video.py",
    "torch.distributed kv transport": ROOT / "services/worker/kv_transfer.py",
}


def lines(doc: Path) -> list[tuple[int, str]]:
    return list(enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1))


def test_no_issue_or_acceptance_numbers() -> None:
    found = [
        f"{doc.relative_to(ROOT)}:{n}: {line}" for doc in DOCS for n, line in lines(doc) if TRACKER_NUMBER.search(line)
    ]
    assert not found, "name what is proven instead:\n" + "\n".join(found)


def test_nothing_is_called_planned() -> None:
    found = [
        f"{doc.relative_to(ROOT)}:{n}: {line}" for doc in DOCS for n, line in lines(doc) if PLANNED_STATUS.search(line)
    ]
    assert not found, "list what is not built under architecture.md's 'Not built yet':\n" + "\n".join(found)


def test_not_built_yet_names_nothing_built() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Not built yet", 1)[1].split("\n## ", 1)[0].lower()
    for thing, module in BUILT.items():
        assert module.is_file(), f"{module.relative_to(ROOT)} is gone: update BUILT"
        assert thing not in section, f"{thing!r} is built ({module.relative_to(ROOT)}) but listed as not built"


def test_every_named_doc_exists() -> None:
    for path in NAMERS:
        for name in set(re.findall(r"docs/[\w-]+\.md", path.read_text(encoding="utf-8"))):
            assert (ROOT / name).is_file(), f"{path.relative_to(ROOT)} names {name}, which does not exist"
