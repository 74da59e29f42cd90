"""A warm-up setting measured on held-out games: one run from empty per value, each trained to the end of
warm-up SFT, then its end-of-warm-up policy's drafts played alone on the same held-out games.

    python experiments/studies/warmup_switch.py actor.warmup_recovery --values true,false --games 20 --out DIR \\
        [--config configs/local.yaml] [--set key=value ...] [--eval-set model.torch_threads=2] [--resume]

For settings such as recovery demonstrations (``actor.warmup_recovery``) and the history window
(``env.history_k``: what the policy is trained and evaluated on), chosen by held-out figures with the
loop rate before and after. Per value, ``honcho start broker inference learner actor`` runs a
run named ``ws-<setting>-<value>`` (the value in ``COMAP_OVERRIDES``) from empty until the learner
publishes its first ``reflect_init`` version, which holds warm-up SFT's final weights, and stops it;
then ``comap eval --method draft_only`` plays that version greedily on ``--games`` games of ``--split``
with the same value (``eval.cycle_stop`` as configured). ``--resume`` keeps a run already warmed up and
an evaluation already written. Writes ``DIR/warmup_switch.json`` and ``DIR/warmup_switch.md``; last line:
``warmup_switch=<setting> <value>: won=W/N loop_rate=L invalid=I ...`` for every value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def eval_command(args: argparse.Namespace, run_dir: Path, override: str, version: int, out: Path) -> list[str]:
    """``comap eval`` of the run's end-of-warm-up drafts, with the run's value and ``--eval-set``."""
    sets = [*args.overrides, override, f"inference.adapter_root={run_dir / 'adapters'}", *args.eval_overrides]
    return [
        sys.executable,
        "-m",
        "comap_async",
        "eval",
        "--config",
        args.config,
        *sum((["--set", s] for s in sets), []),
        "--adapters",
        str(version),
        "--method",
        "draft_only",
        "--split",
        args.split,
        "--games",
        str(args.games),
        "--serve",
        "always",
        "--out",
        str(out),
    ]


def summary_row(value: str, record: dict, report: dict) -> dict:
    wins = round(report["success_rate"] * report["games"])
    return {
        "value": value,
        "run": record["name"],
        "version": record["version"],
        "step": record["step"],
        "warm_up_minutes": round(record["wall_s"] / 60, 1),
        "won": wins,
        "games": report["games"],
        "mean_steps": report["mean_steps"],
        "loop_rate": report.get("loop_rate"),
        "invalid_action_rate": report["invalid_action_rate"],
        "parse_problem_rate": report.get("parse_problem_rate"),
    }


def markdown(setting: str, rows: list[dict]) -> str:
    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        f"# `{setting}` at the end of warm-up SFT (drafts alone, greedy, {rows[0]['games']} held-out games)",
        "",
        "| value | run | end of warm-up | warm-up wall | won | mean steps | loop rate | invalid | unreadable |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['value']} | `{r['run']}` | v{r['version']} (step {r['step']}) | {r['warm_up_minutes']} min | "
        f"{r['won']}/{r['games']} | {r['mean_steps']:.1f} | {num(r['loop_rate'])} | "
        f"{num(r['invalid_action_rate'])} | {num(r['parse_problem_rate'])} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def run_slug(text: str, limit: int = 96) -> str:
    """``method.bce_gate_labels=false`` -> ``method-bce_gate_labels-false``: a setting as part of a run
    name. Past ``limit`` characters (a run name is a directory and a log file's name), the start and a
    hash of the whole: the same settings always give the same name, different ones different names."""
    slug = "".join(c if c.isalnum() or c in "_-" else "-" for c in text)
    if len(slug) <= limit:
        return slug
    return f"{slug[: limit - 9]}-{zlib.crc32(text.encode()):08x}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("setting", help="a config key, e.g. actor.warmup_recovery or env.history_k")
    ap.add_argument("--values", required=True, help="comma-separated, e.g. true,false")
    ap.add_argument("--games", type=int, default=20)
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", default=os.environ.get("COMAP_CONFIG") or str(ROOT / "configs" / "local.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--eval-set", dest="eval_overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--warm-up-max-minutes", type=float, default=90.0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    from comap_async.config import load_config
    from comap_async.wire.messages import REFLECT_INIT
    from experiments.system import run_to_phase

    args.config = str(Path(args.config).resolve())
    values = [v for v in args.values.split(",") if v]
    for value in values:  # a wrong key or value is refused before any run starts
        load_config(args.config, [*args.overrides, f"{args.setting}={value}"])
    root = Path(load_config(args.config, args.overrides).run.root).expanduser()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for value in values:
        name, override = f"ws-{run_slug(f'{args.setting}-{value}')}", f"{args.setting}={value}"
        run_dir, ledger = root / name, args.out / f"{name}.json"
        if (run_dir / "replay").exists() and not args.resume:
            raise SystemExit(f"warmup_switch: {run_dir} exists: --resume goes on with it, or remove it")
        record = run_to_phase(
            name,
            REFLECT_INIT,
            args.config,
            [*args.overrides, override],
            args.warm_up_max_minutes,
            args.out,
            root,
            ledger,
        )
        out = args.out / f"{name}-eval"
        if not (out / "eval.json").exists():
            with open(args.out / f"{name}-eval.log", "ab") as log:
                rc = subprocess.run(
                    eval_command(args, run_dir, override, record["version"], out),
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ).returncode
            if rc != 0:
                raise SystemExit(f"warmup_switch: comap eval of {name} exited {rc} (see {log.name}); --resume retries")
        rows.append(summary_row(value, record, json.loads((out / "eval.json").read_text())))
    (args.out / "warmup_switch.json").write_text(json.dumps({"setting": args.setting, "rows": rows}, indent=2))
    (args.out / "warmup_switch.md").write_text(markdown(args.setting, rows))
    print(
        f"warmup_switch={args.setting} "
        + " ".join(
            f"{r['value']}: won={r['won']}/{r['games']} loop_rate={r['loop_rate']} "
            f"invalid={r['invalid_action_rate']:.3f}"
            for r in rows
        )
    )


if __name__ == "__main__":
    main()
