"""``comap experiment``: run an experiment spec end to end, or redraw its report.

    comap experiment run experiments/NAME.yaml [--split S] [--games N|all] [--data DIR] [--out DIR]
    comap experiment report experiments/NAME.yaml [--out DIR]     # results.md/.png from results.json
    comap experiment readme                                        # the README's result tables

``run`` is resumable: stopped anywhere (Ctrl-C, kill -9, a restart), the same command goes on, keeping
the source, the finished forks and the finished games. ``--split``, ``--games`` and ``--data`` replay the
same spec on other games; their results go to ``results/NAME-SPLIT[-Ngames]`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="train and evaluate what the spec says; resumable")
    run.add_argument("spec", type=Path)
    run.add_argument("--split", default=None, help="evaluate on this split instead of the spec's")
    run.add_argument("--games", default=None, help="'all' or N games drawn over the task types (default: the spec's)")
    run.add_argument(
        "--data", default=None, help="the environment's data root (default: the spec's, else the config's)"
    )
    run.add_argument("--out", type=Path, default=None, help="results directory (default: results/NAME[-SPLIT])")
    run.add_argument("--train-only", action="store_true", help="stop once the source and the forks are trained")
    report = sub.add_parser("report", help="redraw results.md and results.png from results.json")
    report.add_argument("spec", type=Path)
    report.add_argument("--out", type=Path, default=None)
    sub.add_parser("readme", help="regenerate the README's result tables from their results.json")


def games_arg(text: str | None) -> int | str | None:
    if text is None or text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise SpecError(f"--games must be 'all' or a positive number, got {text!r}")
    return int(text)


def out_dir(spec_name: str, split: str | None, out: Path | None, games: int | str | None = None) -> Path:
    """``results/NAME``, with the split and the game count when they are not the spec's: a replay on other
    games never writes into the spec's own table."""
    if out is not None:
        return out
    return REPO / "results" / (spec_name + (f"-{split}" if split else "") + (f"-{games}games" if games else ""))


def run(args: argparse.Namespace) -> int:
    if args.action == "readme":
        from experiments.report import readme_tables

        readme = REPO / "README.md"
        try:
            new = readme_tables(readme.read_text(), REPO)
        except OSError as exc:
            raise SpecError(f"README.md names a results file that cannot be read: {exc}") from None
        readme.write_text(new)
        print("README.md: result tables regenerated", file=sys.stderr)
        return 0
    spec = load_spec(args.spec)
    if args.action == "report":
        from experiments.report import write_report

        out = out_dir(spec.name, None, args.out)
        path = out / "results.json"
        if not path.is_file():
            raise SpecError(f"{path}: no results yet (run `comap experiment run {args.spec}`)")
        results = write_report(spec, json.loads(path.read_text()), out)
        print("\n".join(results["verdicts"]) or "no comparison yet: rows unfinished")
        return 0
    from evaluator.eval_runner import EvalIncomplete, ServerStartError
    from experiments.runner import Experiment
    from experiments.state import STATE_DIR

    split = args.split if args.split not in (None, spec.evaluation.split) else None
    games = games_arg(args.games)
    games = games if games != spec.evaluation.games else None
    out = out_dir(spec.name, split, args.out, games)
    # what the table trained is kept beside its own results, whichever games this run plays
    state = out_dir(spec.name, None, args.out) / STATE_DIR
    experiment = Experiment(spec, args.spec, out, split=split, games=games, data=args.data, state=state)
    try:
        results = experiment.run(train_only=args.train_only)
    except (EvalIncomplete, ServerStartError) as exc:
        raise SpecError(f"evaluation: {exc} (the same command goes on from the finished games)") from None
    if results:
        print("\n".join(results["verdicts"]) or "no comparison: rows unfinished")
    return 0
