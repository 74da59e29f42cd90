"""The README's result tables are generated from committed result files: each block between
``<!-- results: FILE -->`` and ``<!-- /results -->`` must be what ``comap experiment readme`` writes from
FILE, FILE must lie under results/ and name a spec in experiments/, and no other result table is quoted."""

from __future__ import annotations

import json
import re
from pathlib import Path

from experiments.report import README_BLOCK, readme_tables

REPO = Path(__file__).resolve().parents[2]


def test_every_readme_result_table_is_the_one_its_results_file_generates():
    readme = (REPO / "README.md").read_text()
    blocks = list(README_BLOCK.finditer(readme))
    assert blocks, "the README quotes no generated result table"
    for m in blocks:
        path = REPO / m["path"]
        assert path.is_file() and path.parent.parent == REPO / "results", f"{m['path']}: not a committed result file"
        results = json.loads(path.read_text())
        assert (REPO / results["spec"]).is_file(), f"{m['path']} names a spec that is not in the repository"
        assert results["rows"], f"{m['path']} holds no played row"
    assert readme_tables(readme, REPO) == readme, (
        "a README result table differs from its results file: run `comap experiment readme`"
    )


def test_a_changed_figure_is_caught(tmp_path):
    readme = (REPO / "README.md").read_text()
    m = next(README_BLOCK.finditer(readme))
    results = json.loads((REPO / m["path"]).read_text())
    row = next(iter(results["figures"]))
    tampered = readme.replace(f"| `{row}`", f"| `{row}` ", 1)
    if tampered == readme:  # a seed row comes first
        tampered = re.sub(r"\| (\d+)/(\d+) \|", lambda x: f"| {int(x[1]) + 1}/{x[2]} |", readme, count=1)
    assert tampered != readme and readme_tables(tampered, REPO) != tampered


def test_the_readme_quotes_no_result_table_outside_a_generated_block():
    readme = README_BLOCK.sub("", (REPO / "README.md").read_text())
    headers = [line for line in readme.splitlines() if line.startswith("|") and re.search(r"\bwon\b", line)]
    assert not headers, f"a result table not generated from results/: {headers}"
