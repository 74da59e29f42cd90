"""The README and docs/ link only to files that exist, nothing in the repository points at a design
document outside it, no doc cites a path outside the repository, and no doc is keyed by a working session
or an issue number."""

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


# a working session's number, an issue tracker's number: the notebook's keys, which a reader of the checkout
# cannot look up ("session 41", "sessions 43-46", "issue 26", "issue #26", "#26", "vllm#20284")
NOTEBOOK_KEY = re.compile(r"\b[Ss]essions? \d+|\b[Ii]ssues? #?\d+|(?<!&)#\d{2,}\b")
# pages whose owner has not yet rewritten them without such keys; remove a page once it has none
NOTEBOOK_KEYS_PENDING: set[str] = set()


def test_no_doc_refers_to_a_session_or_an_issue_number():
    """The README, the changelog and docs/ say what the system does and what was learned, dated where it
    matters, never keyed by a working session or an issue number."""
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    offenders = []
    for page in pages:
        name = str(page.relative_to(REPO))
        if name in NOTEBOOK_KEYS_PENDING:
            continue
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            offenders += [f"{name}:{number}: {m.group(0)}" for m in NOTEBOOK_KEY.finditer(URL.sub("", line))]
    assert not offenders, "docs keyed by a session or an issue number:\n" + "\n".join(offenders)


def test_the_notebook_key_pattern_catches_what_it_is_for():
    caught = ["in session 41", "Sessions 43-46 measured", "issue 26's acceptance", "issue #29", "see #31", "vllm#20284"]
    passed = ["the session's end", "a 2-core session", "## 12. Deviations", "&#39;", "issue a command"]
    assert all(NOTEBOOK_KEY.search(text) for text in caught)
    assert not any(NOTEBOOK_KEY.search(text) for text in passed)
