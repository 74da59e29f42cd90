"""``comap eval``: run a split once with fixed adapters and the action gate; write JSON + Markdown.

This module is the command (its arguments, and the files and lines it writes); the run itself is
:mod:`evaluator.eval_runner` (games, the embedded server when none answers) and the report
:mod:`evaluator.eval_report`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--split",
        required=True,
        help="ALFWorld: train, valid_seen, valid_unseen or valid_train; ScienceWorld: train, dev or test",
    )
    p.add_argument(
        "--per-task",
        type=int,
        default=None,
        metavar="N",
        help="ScienceWorld: N variations of each task, drawn with the run seed (sets env.per_task)",
    )
    p.add_argument(
        "--games",
        type=int,
        default=None,
        help="evaluate N games drawn with run.seed, spread over the task types (default: all)",
    )
    p.add_argument("--data", default=None, help="ALFWorld data root (default: env.data_dir or $ALFWORLD_DATA)")
    p.add_argument(
        "--adapters",
        default="latest",
        help="adapter version to evaluate: a number, 'latest' (newest in the adapter root) or 'base'",
    )
    p.add_argument("--out", required=True, help="directory for eval.json and eval.md")
    p.add_argument("--envs", type=int, default=None, help="concurrent episodes (default: actor.envs)")
    p.add_argument(
        "--reflection-metrics",
        action="store_true",
        help="judge every evaluated step by two branches (draft first, reflected action first; the "
        "game's expert continues both until the episode ends): URR, HRR, BRP",
    )
    p.add_argument(
        "--reflect-init-labels",
        action="store_true",
        help="instead of the CoMap loop, play reflection-mode initialisation on the split's walkthrough "
        "states with these adapters and report the label distribution (y=1, y=0 from equal drafts, "
        "y=0 from ties or worse); nothing is stored",
    )
    p.add_argument(
        "--probes",
        action="store_true",
        help="instead of the CoMap loop, the held-out probes along each game's walkthrough (greedy): "
        "world-model Delta-F1 on the expert's and on seeded failure transitions, draft accuracy and "
        "admissible rate; last line wm_delta_f1=X draft_accuracy=Y admissible_rate=Z",
    )
    p.add_argument(
        "--counterfactual",
        action="store_true",
        help="with --probes: reflect on each state's greedy draft four times, shown the world model's "
        "prediction, the draft's true next state, a contradicting state and none; how p and the gate's "
        "decision move between them (does the reflection read the world model?), on the walkthrough's "
        "states and on the states the policy's own drafts lead to (one table each)",
    )
    p.add_argument(
        "--cycle-check",
        action="store_true",
        help="with eval.cycle_stop: play every game to its end anyway, and record per game whether the "
        "projection made at its first recurring state was what was played (eval.json's cycle_check; "
        "experiments/studies/cycle_stop.py reads it)",
    )
    from comap_async.config import EVAL_METHODS

    p.add_argument(
        "--method",
        default=None,
        choices=EVAL_METHODS,
        help="how the agent acts (default: eval.method, comap): the CoMap loop (draft, imagine, reflect, "
        "action gate), react (a thought then an action, no world model, no reflection), "
        "imagine_and_act (the draft's imagined consequence, then a chosen final action, no action "
        "gate), draft_only (the policy's draft executed as is) or lookahead (K sampled candidates "
        "imagined D steps ahead by the world model, the critic's best executed: eval.lookahead_k)",
    )
    p.add_argument(
        "--serve",
        choices=("auto", "never", "always"),
        default="auto",
        help="start an embedded inference server for this run: when none answers (auto), never, always",
    )
    p.add_argument(
        "--serve-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="how long to wait for the server started for this run to answer (default 600 s: loading a "
        "model on a busy CPU takes minutes)",
    )


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from evaluator.eval_report import markdown
    from evaluator.eval_runner import EvalIncomplete, EvalSpec, ServerStartError, run_eval

    overrides = list(args.overrides) + ([f"env.data_dir={args.data}"] if args.data else [])
    if args.per_task is not None:
        overrides.append(f"env.per_task={args.per_task}")
    cfg = load_config(args.config, overrides)
    log = configure_logging("eval", run=cfg.run.name)
    try:
        if args.cycle_check and cfg.eval.cycle_stop == 0:
            raise ValueError("--cycle-check measures eval.cycle_stop's projections: set it (--set eval.cycle_stop=3)")
        spec = EvalSpec(
            split=args.split,
            games=args.games,
            adapters=args.adapters,
            envs=args.envs,
            reflection_metrics=args.reflection_metrics,
            reflect_init_labels=args.reflect_init_labels,
            probes=args.probes,
            counterfactual=args.counterfactual,
            method=args.method or cfg.eval.method,
            cycle_check=args.cycle_check,
        )
    except ValueError as exc:
        print(f"comap eval: error: {exc}", file=sys.stderr)
        return 2
    try:
        if cfg.inference.adapter_root is None:  # the run's own adapters: played as they trained
            from comap_async.run_files import check_played_as_trained

            check_played_as_trained(cfg, cfg.run.dir)
        report = run_eval(
            cfg, spec, log, config=args.config, overrides=overrides, serve=args.serve, serve_timeout=args.serve_timeout
        )
    except (
        ValueError,
        ServerStartError,
        EvalIncomplete,
    ) as exc:  # bad split, unknown version, no server: one clear line
        print(f"comap eval: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    if "counterfactual" in report:
        from evaluator.counterfactual import counterfactual_lines

        lines = counterfactual_lines(report["counterfactual"])
        (out / "eval.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
        print("\n".join(lines))
        return 0
    if "probes" in report:
        from evaluator.probes import probe_line

        log.info("eval.done", out=str(out), **{k: v for k, v in report["probes"].items() if not isinstance(v, list)})
        print(probe_line(report["probes"]))
        return 0
    (out / "eval.md").write_text(markdown(report))
    print(markdown(report).split("\n\n")[1])
    if "reflect_init_labels" in report:
        from comap_async.commands.stats import label_line

        print("reflect_init " + label_line(report["reflect_init_labels"]))
    log.info("eval.done", out=str(out), success_rate=report["success_rate"], games=report["games"])
    return 0
