"""The README and docs/ link only to files that exist, and nothing in the repository points at a
design document outside it (issue 30, docs)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 5
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_no_reference_to_the_design_document_outside_the_repository():
    offenders = []
    for path in REPO.rglob("*"):
        if path.suffix not in (".py", ".md", ".yaml", ".toml") or ".git" in path.parts or "docs" in path.parts:
            continue
        if "DESIGN.md" in path.read_text(errors="replace") and path != Path(__file__).resolve():
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders
