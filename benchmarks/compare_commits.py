"""One benchmark on two commits of this repository, interleaved in one run, so the ratio is taken under the
same machine load: "no performance lost" across a refactor.

Each commit is checked out once into a git worktree under ``--work`` (a temporary directory by default;
reused when it is already there, ``git worktree remove`` when done);
then, for each round, the benchmark runs in the before tree and then in the after tree (the order
alternates between rounds), each with ``PYTHONPATH`` set to its tree so that every ``comap`` process the
benchmark starts imports that tree's code. The benchmark's last line (``key=value ...``, as every
benchmark here prints its figure last) is read each time.

    python benchmarks/compare_commits.py --before REV --after HEAD --rounds 3 -- \\
        benchmarks/coevolve_throughput.py --settings fast --rounds 1 --steps 40

Prints each round's figures, then per key the medians and after / before; last line
``compare_commits KEY=ratio ...`` (after over before: 1.00 is no change; above 1 faster for a rate).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"([A-Za-z_][\w.]*)=(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\b")


def last_figures(output: str) -> dict[str, float]:
    """The numeric ``key=value`` pairs of the last line that holds any."""
    for line in reversed(output.strip().splitlines()):
        found = {k: float(v) for k, v in FIGURE.findall(line)}
        if found:
            return found
    return {}


def worktree(rev: str, work: Path) -> Path:
    """A worktree of ``rev`` under ``work`` (its commit hash names it, so a rerun reuses it)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    tree = work / sha[:12]
    if not (tree / ".git").exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO, check=True)
    return tree


def run_in(tree: Path, command: list[str], timeout_s: float) -> tuple[dict[str, float], float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *command], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    took = time.monotonic() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise SystemExit(f"{tree.name}: {' '.join(command)} exited {proc.returncode}: " + " | ".join(tail))
    return last_figures(proc.stdout), took, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the commit before the change (any git revision)")
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "comap-compare-commits",
        help="where the worktrees go (outside the repository, so its own checks do not walk them)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one benchmark run may take")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark and its arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("compare_commits: no benchmark given (append: -- benchmarks/NAME.py ARGS)")
    trees = {"before": worktree(args.before, args.work), "after": worktree(args.after, args.work)}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            figures, took, line = run_in(trees[side], command, args.timeout)
            runs[side].append(figures)
            print(f"round {r + 1}/{args.rounds} {side} ({trees[side].name}, {took:.0f} s): {line}", flush=True)
    keys = [k for k in runs["after"][0] if all(k in f for side in runs.values() for f in side)]
    ratios = {}
    for k in keys:
        before = statistics.median(f[k] for f in runs["before"])
        after = statistics.median(f[k] for f in runs["after"])
        ratios[k] = after / before if before else float("nan")
        spread = {s: (min(f[k] for f in runs[s]), max(f[k] for f in runs[s])) for s in runs}
        print(
            f"{k}: before {before:.4g} [{spread['before'][0]:.4g}, {spread['before'][1]:.4g}]  "
            f"after {after:.4g} [{spread['after'][0]:.4g}, {spread['after'][1]:.4g}]  after/before {ratios[k]:.3f}"
        )
    print("compare_commits " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
