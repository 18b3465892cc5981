"""Every citation `Note: X` in the repository (code, tests, docs) resolves: to a `[Note: X]` block
in the code or to a `### X` heading in docs/*.md (the design-level prose of a Note lives in
docs/design.md, named as the Note is). A citation may run on past the name ("Note: X in file.py",
"Note: X: detail") and may wrap across comment lines; it resolves when a known name begins it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.processes import ROOT

BLOCK = re.compile(r"\[Note: ([^\]]+)\]")
HEADING = re.compile(r"^### (.+?)\s*$", re.M)
CITATION = re.compile(r"(?<!\[)Note: ")
# A line break inside a citation, with the next line's indentation and comment or docstring marker.
WRAP = re.compile(r"\s*\n\s*(?:#+ ?|\* )?")


def sources(root: Path) -> list[Path]:
    """The repository's Python and Markdown files, its own only (no virtual environment, no git)."""
    skip = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
    return [
        path
        for path in sorted(root.rglob("*"))
        if path.suffix in (".py", ".md") and path.is_file() and not skip & set(path.relative_to(root).parts)
    ]


def note_names(root: Path, files: list[Path]) -> set[str]:
    """The names a citation may point at: every `[Note: X]` block and every `### X` heading of docs/."""
    names = {WRAP.sub(" ", m.group(1)).strip() for path in files for m in BLOCK.finditer(path.read_text())}
    names |= {m.group(1) for path in sorted((root / "docs").glob("*.md")) for m in HEADING.finditer(path.read_text())}
    return names


def dangling(root: Path) -> list[str]:
    """`file:line: text` of each citation that no known name begins."""
    files = sources(root)
    names = note_names(root, files)
    found = []
    for path in files:
        if path == Path(__file__).resolve():  # its examples are strings
            continue
        text = path.read_text()
        for m in CITATION.finditer(text):
            cited = WRAP.sub(" ", text[m.end() : m.end() + 200])
            if not any(cited.startswith(name) and not cited[len(name) : len(name) + 1].isalnum() for name in names):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(root)}:{line}: Note: {cited[:60].rstrip()}")
    return found


def test_every_note_citation_resolves() -> None:
    missing = dangling(Path(ROOT))
    assert not missing, "citations with no `[Note: X]` block nor `### X` heading in docs/*.md:\n" + "\n".join(missing)


def test_a_dangling_citation_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("### shard layout\nwhy\n")
    (tmp_path / "a.py").write_text(
        "# [Note: kept for backward]\n# why\nx = 1  # (a.py, Note: kept for\n# backward)\n"
        "y = 2  # (docs/design.md, Note: shard layout)\nz = 3  # (Note: no such note)\n"
    )
    assert dangling(tmp_path) == ["a.py:6: Note: no such note)"]
