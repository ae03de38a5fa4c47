"""docs/structure.md lists every module with its docstring's first sentence (regenerate when stale)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A finished sentence ends in '.', '!' or '?', perhaps followed by closing brackets, quotes or backticks.
SENTENCE_END = re.compile(r"[.!?][)\]\"'`]*$")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_structure", ROOT / "scripts" / "gen_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_structure_doc_is_current() -> None:
    module = generator()
    current = (ROOT / "docs" / "structure.md").read_text()
    assert current == module.render(), "docs/structure.md is stale: run python scripts/gen_structure.py"
    assert "(no docstring)" not in current, "every module needs a docstring"


def test_no_entry_ends_mid_sentence() -> None:
    entries = [line for line in (ROOT / "docs" / "structure.md").read_text().splitlines() if line.startswith("- `")]
    assert entries
    cut = [line for line in entries if not SENTENCE_END.search(line.rstrip())]
    assert not cut, "entries that end mid-sentence:\n" + "\n".join(cut)


def test_first_sentence_joins_wrapped_lines_and_stops_at_the_first_full_stop() -> None:
    first_sentence = generator().first_sentence
    doc = "The router's intake: parse the messages,\nread headers (e.g. sizes) only. Then more.\n\nDetails."
    assert first_sentence(doc) == "The router's intake: parse the messages, read headers (e.g. sizes) only."
    assert first_sentence("One paragraph\nwrapped (ends here.)\n\nNext.") == "One paragraph wrapped (ends here.)"
    assert first_sentence("Version 1.5 of `a.b`, done!") == "Version 1.5 of `a.b`, done!"
