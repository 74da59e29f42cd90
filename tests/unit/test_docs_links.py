"""The README and docs/ link only to files that exist, nothing in the repository points at a design
document outside it (issue 30, docs), and no doc cites a path outside the repository."""

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


URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
# an absolute path under a root outside any checkout (a run directory, a scratch file, someone's home)
OUTSIDE_ROOT = re.compile(r"(?<![\w./~$-])/(?:work|tmp|root|home)\b[^\s`'\")\]>]*")
# a relative path that starts by climbing (``../x``)
CLIMBING = re.compile(r"(?<![\w./~$-])\.\./[^\s`'\")\]>]*")


def _climbs_out(page: Path, target: str) -> bool:
    """README.md: any ``../`` leaves the repository. docs/*.md: ``../README.md`` stays inside; a target that
    resolves outside the repository leaves it, and so does one that does not exist there (``../shared/...`` in
    prose is a path beside the checkout, not ``<repo>/shared``)."""
    if page.parent == REPO:
        return True
    resolved = (page.parent / target).resolve()
    return not resolved.is_relative_to(REPO) or not resolved.exists()


def test_no_doc_cites_a_path_outside_the_repository():
    """The README and docs/ name nothing outside the repository: a reader has only the checkout.
    Install locations the system writes itself (``~/.cache/comap-async/...``) and URLs are not citations."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    offenders = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            line = URL.sub("", line)
            found = [path.rstrip(".,;:") for path in OUTSIDE_ROOT.findall(line)]
            found += [t for t in (path.rstrip(".,;:") for path in CLIMBING.findall(line)) if _climbs_out(page, t)]
            offenders += [f"{page.relative_to(REPO)}:{number}: {path}" for path in found]
    assert not offenders, (
        "docs cite paths outside the repository; a reader of the checkout cannot follow them. Name a run by its "
        "name (`run r50`, `runs/r50` in a command), drop a script that is not in the repository (say so where it "
        "matters), give data as `$ALFWORLD_DATA` or `comap data alfworld --archive ...`, and quote results only "
        "from `comap experiment run experiments/NAME.yaml` (results/), marking older ones as not regenerable:\n"
        + "\n".join(offenders)
    )
