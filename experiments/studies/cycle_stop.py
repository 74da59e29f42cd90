"""Is ``eval.cycle_stop``'s premise true here, and what does it save? One greedy evaluation played
to the end (``comap eval --cycle-check``): at each episode's first recurring state the projection is
made and kept, the episode plays on, and at its end the two are compared (actors/cycles.py).

    python experiments/studies/cycle_stop.py --split valid_seen --games 10 --adapters N [--occurrences 3]
        [--method comap] [--config configs/local.yaml] [--set key=value ...] [--out DIR]

Runs ``comap eval`` (its own embedded server when none answers) and reads its ``eval.json``. Prints,
per episode, the step the stop would have ended it at and whether every figure the projection gave
(won, steps, loops, invalid actions, revisions, parse problems, gate reasons, Delta-F1 scores) is
the played one. Last line: ``episodes=N recurred=R exact=E outcome_exact=O steps_saved=S`` (O: the
projections whose won, steps and reward were the played ones; S: the share of all played steps that
the stop would have skipped). In the draft's turns form (``--set env.prompt_form=draft_turns``, as in
``configs/local.yaml``) the premise is measured, not derived (actors/cycles.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--games", type=int, default=10)
    ap.add_argument("--adapters", default="latest")
    ap.add_argument("--method", default="comap")
    ap.add_argument("--occurrences", type=int, default=3)
    ap.add_argument("--envs", type=int, default=None)
    ap.add_argument("--out", default=None, help="where comap eval writes (default: a temporary directory)")
    ap.add_argument("--set", action="append", default=[], help="config override, repeatable")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="cycle-stop-"))
    cmd = [sys.executable, "-m", "comap_async", "eval", "--config", args.config, "--split", args.split]
    cmd += ["--games", str(args.games), "--adapters", args.adapters, "--method", args.method, "--out", str(out)]
    cmd += [] if args.envs is None else ["--envs", str(args.envs)]
    cmd += ["--cycle-check"]
    overrides = [f"eval.cycle_stop={args.occurrences}", *args.set]
    for item in overrides:
        cmd += ["--set", item]
    if subprocess.run(cmd, cwd=REPO).returncode != 0:
        print(f"comap eval failed (its report, if any, is in {out})", file=sys.stderr)
        return 1
    report = json.loads((out / "eval.json").read_text())
    episodes = report["episodes"]
    checked = [e for e in episodes if "cycle_check" in e]
    exact = [e for e in checked if e["cycle_check"]["exact"]]
    outcome = [e for e in checked if e["cycle_check"]["outcome_exact"]]
    played = sum(e["steps"] for e in episodes)
    saved = sum(e["steps"] - e["cycle_check"]["at"] for e in checked)
    for e in episodes:
        c = e.get("cycle_check")
        verdict = (
            "no recurrence"
            if c is None
            else f"stop at {c['at']}: "
            + ("exact" if c["exact"] else f"differs in {c['differ']}")
            + ("" if c["exact"] or not c["outcome_exact"] else " (outcome exact)")
        )
        print(f"{e['game']}: won={e['won']} steps={e['steps']} {verdict}")
    print(f"report: {out / 'eval.json'}")
    print(
        f"episodes={len(episodes)} recurred={len(checked)} exact={len(exact)} outcome_exact={len(outcome)} "
        f"steps_saved={saved / max(1, played):.3f}"
    )
    return 0 if len(exact) == len(checked) else 2


if __name__ == "__main__":
    raise SystemExit(main())
