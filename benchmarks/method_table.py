"""The method table: CoMap against its ablations from one warm-up, and the prompting
methods on the warm-up's version, on the same held-out games.

    python benchmarks/method_table.py SOURCE_RUN --version N --variants comap,frozen_wm,no_action_gate \\
        --minutes 30 --games 20 --out method-table/ [--repeat comap] [--config configs/local.yaml] [--set ...] \\
        [--eval-set model.torch_threads=2] [--envs 8] [--resume] [--train-only] [--from-empty]

0. With ``--from-empty``, ``SOURCE_RUN`` is first trained from empty (or resumed): the whole system but the
   evaluator runs until it publishes its first co-evolution version (warm-up SFT and reflection-mode
   initialisation done), which is the fork point unless ``--version`` says otherwise
   (``OUT/source.json``: its wall time). One command then makes a table from nothing, e.g. ScienceWorld's:
   ``COMAP_CONFIG=configs/scienceworld-local.yaml python benchmarks/method_table.py sw --from-empty ...``.
1. ``comap fork`` makes one run per variant from run ``SOURCE_RUN`` at version ``N`` (a warmed-up
   version: its checkpoint, adapters and replay; ``--version`` default: the newest forkable). A
   variant is ``comap`` (the method itself) or ablation names joined by ``+``, and may carry config
   settings (``learner.policy_wm_aux=0.2``, PaW); ``--repeat V`` forks variant V a second time, to
   show run-to-run noise.
2. Each fork trains alone on the machine for ``--minutes`` of wall time: ``honcho start broker
   inference learner actor`` with ``run.name`` and the variant's ablations in ``COMAP_OVERRIDES``
   (no evaluator: the table evaluates every fork afterwards on the same games), then SIGINT.
3. ``comap compare`` plays every fork's newest version (its ablation applied) and the prompting
   methods with the source's version N (``--methods``, default ``draft_only,react,imagine_and_act``;
   ``--methods ""`` plays the forks' rows only, and a later ``--resume`` with methods adds theirs)
   on ``--games`` games of ``--split``: success rate, world-model Delta-F1 on the executed
   (on-policy) transitions, mean steps, revision, invalid-action and loop rates; one table, one PNG.

Writes ``OUT/method_table.md`` (the table with the fork point and each fork's wall time),
``OUT/compare.json`` and ``OUT/compare.png``. Last line: ``method_table_rows=K out=OUT``.

On a 2-core CPU a table of 20 games is many hours (a CoMap row alone is over an hour), more than
one sitting: ``OUT/forks.json`` records each fork and its training time and ``OUT/cells`` each
measured row and episode, so ``--resume`` goes on where a stopped table was (a fork whose training
was cut short is forked and trained again; a row cut short keeps its finished episodes and plays
its other games); ``--resume --refork RUN`` forks and trains a finished fork again (its code or
settings changed), keeping the old run directory beside it. ``--train-only`` stops after the forks
have trained; ``--eval-set`` sets what only the evaluation uses (``model.torch_threads=2``: the
server has the cores to itself then).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.system import run_system, run_to_phase  # noqa: E402 - the repo must be on sys.path first


def variant_overrides(variant: str) -> list[str]:
    """``comap`` -> none; ``frozen_wm+no_wmsd`` -> each switch on; a part with ``=`` is a config
    override as is (a related method's switch: ``learner.policy_wm_aux=0.2``)."""
    from comap_async.config import AblationConfig

    if variant == "comap":
        return []
    parts = variant.split("+")
    settings = [p for p in parts if "=" in p]
    names = [p for p in parts if "=" not in p]
    unknown = [n for n in names if n not in AblationConfig.model_fields]
    if unknown:
        raise SystemExit(
            f"method_table: unknown ablation {', '.join(unknown)}; known: {', '.join(AblationConfig.model_fields)}"
        )
    return [f"ablation.{n}=true" for n in names] + settings


def refuse_bad_variants(config: str, overrides: list[str], variants: list[str]) -> None:
    """Each variant's config is loaded before any run starts (a warm-up takes hours): an unknown ablation,
    or a setting the config refuses (``learner.policy_wm_aux`` without its entropy source under
    ``env.draft_turns``), stops the table here with one line, not a fork's processes minutes later."""
    from comap_async.config import ConfigError, load_config

    for variant in variants:
        try:
            load_config(config, [*overrides, *variant_overrides(variant)])
        except ConfigError as exc:
            raise SystemExit(f"method_table: variant {variant!r}: {exc}") from None


def run_slug(text: str, limit: int = 96) -> str:
    """``learner.bce_gate_labels=false`` -> ``learner-bce_gate_labels-false``: a setting as part of a run
    name. Past ``limit`` characters (a run name is a directory and a log file's name), the start and a
    hash of the whole: the same settings always give the same name, different ones different names."""
    slug = "".join(c if c.isalnum() or c in "_-" else "-" for c in text)
    if len(slug) <= limit:
        return slug
    return f"{slug[: limit - 9]}-{zlib.crc32(text.encode()):08x}"


def plan_forks(
    variants: list[str], source: str, done: dict[str, dict], replace: frozenset[str] = frozenset()
) -> list[tuple[str, str, str]]:
    """``(run name, variant, action)`` per variant: ``keep`` a fork the ledger ``done`` records as
    trained, ``refork`` one forked but not trained to the end (so every fork trains alike), ``replace``
    a trained one whose run name is in ``replace`` (``--refork``: its code or settings changed), else
    ``fork``. A variant named twice (``--repeat``) gets a second run, ``<name>-again``."""
    plan: list[tuple[str, str, str]] = []
    for variant in variants:
        name = f"{source}-{run_slug(variant)}"
        if any(name == n for n, _, _ in plan):
            name += "-again"
        if name not in done:
            action = "fork"
        elif "wall_s" not in done[name]:
            action = "refork"
        else:
            action = "replace" if name in replace else "keep"
        plan.append((name, variant, action))
    unknown = sorted(replace - {n for n, _, _ in plan})
    if unknown:
        raise SystemExit(
            f"method_table: --refork {', '.join(unknown)} names no fork of this table; its forks: "
            f"{', '.join(n for n, _, _ in plan)}"
        )
    return plan


def set_aside(run_dir: Path) -> Path | None:
    """Move a replaced fork's run directory to ``<name>.replaced-<time>`` beside it (kept, not deleted:
    its rows were measured on it); None when there was none."""
    if not run_dir.exists():
        return None
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(aside)
    return aside


def train(
    name: str,
    variant: str,
    config: str,
    overrides: list[str],
    minutes: float,
    log_dir: Path,
    run_dir: Path,
) -> float:
    """Run the forked run ``name`` (in ``run_dir``) for ``minutes``; returns the wall time it ran."""
    return run_system(name, config, [*overrides, *variant_overrides(variant)], minutes, log_dir, run_dir)


def trained_to(run_dir: Path, record: dict) -> str:
    """``, v7 -> v12 (learner steps 107 -> 157)``: where a fork's training got in its wall time (a
    variant with less to train, e.g. ``frozen_wm``, takes more steps in the same time)."""
    from actors.eval_runner import resolve_version
    from comap_async.run_files import VERSION_META
    from comap_async.wire.messages import POLICY, adapter_name

    adapters = run_dir / "adapters"
    version = resolve_version("latest", adapters) if adapters.is_dir() else 0
    meta = adapters / adapter_name(POLICY, version) / VERSION_META
    if not version or not meta.is_file():
        return ""
    step = json.loads(meta.read_text()).get("step")
    return f", v{record['version']} -> v{version} (learner steps {record['step']} -> {step})"


def gate_by_version(run_dir: Path, since_ts: float) -> list[tuple[int, int, int]]:
    """``(policy version, samples whose reflected action the action gate executed, gated samples)``
    over the gate's samples the fork stored itself (stamped after ``since_ts``, its fork point): a
    CoMap row is CoMap only while its gate opens."""
    from broker.ingest import record_from_store
    from broker.store import ReplayStore
    from comap_async.commands.stats import gates_by_version
    from comap_async.wire.messages import STORES

    store = ReplayStore(run_dir / "replay", dict.fromkeys(STORES, 1 << 40), readonly=True)
    try:
        records = [record_from_store("reflections", raw) for raw in store.iter_store("reflections")]
    finally:
        store.close()
    own = [rec for rec in records if float(rec.get("ts") or 0.0) > since_ts]
    return [(g["version"], round(g["revision_accepted"] * g["samples"]), g["samples"]) for g in gates_by_version(own)]


def gate_line(rows: list[tuple[int, int, int]]) -> str:
    """``; action gate opened on 26 of 136 samples (v19 24/50, v20 0/52, v21 2/34)``"""
    if not rows:
        return ""
    opened, n = sum(r[1] for r in rows), sum(r[2] for r in rows)
    each = ", ".join(f"v{v} {o}/{k}" for v, o, k in rows)
    return f"; action gate opened on {opened} of {n} samples ({each})"


def compare_command(args: argparse.Namespace, runs: list[Path], source: Path, version: int) -> list[str]:
    """``comap compare`` over the trained forks and the prompting methods on the source's version N,
    with the config and settings the forks trained under (and ``--eval-set``)."""
    return [
        sys.executable,
        "-m",
        "comap_async",
        "compare",
        *[str(r) for r in runs],
        "--split",
        args.split,
        "--games",
        str(args.games),
        "--methods",
        args.methods,
        "--methods-from",
        f"{source}:{version}",
        "--out",
        str(args.out),
        *(["--envs", str(args.envs)] if args.envs else []),
        *(["--resume"] if args.resume else []),
        "--config",
        args.config,
        *sum((["--set", o] for o in args.overrides + args.eval_overrides), []),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="the warmed-up run (its run.name under run.root, or its directory)")
    ap.add_argument("--version", type=int, default=None, help="the source's version to fork (default: newest forkable)")
    ap.add_argument("--variants", default="comap,frozen_wm,no_action_gate")
    ap.add_argument("--repeat", default="", help="a variant forked a second time (run-to-run noise)")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall time each fork trains")
    ap.add_argument("--games", type=int, default=20)
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--methods", default="draft_only,react,imagine_and_act")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--envs", type=int, default=None, help="games played at once in the evaluation (default: actor.envs)"
    )
    ap.add_argument(
        "--config",
        default=os.environ.get("COMAP_CONFIG") or str(ROOT / "configs" / "local.yaml"),
        help="the config of the forks' training and of the evaluation (default: $COMAP_CONFIG, else the "
        "Procfile's configs/local.yaml)",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument(
        "--eval-set",
        dest="eval_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the evaluation only, after --set (e.g. model.torch_threads=2: the server alone on the "
        "cores once the forks have trained)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="go on from OUT: forks already trained (OUT/forks.json) are kept, a fork whose training was cut "
        "short is forked again, and rows already measured (OUT/cells) are not played again",
    )
    ap.add_argument(
        "--refork",
        default="",
        metavar="RUN[,RUN]",
        help="with --resume: these forks (run names, e.g. r31-comap) are forked and trained again although "
        "trained (their old run directory is kept beside as RUN.replaced-TIME; their rows are played again, "
        "being older than the new adapters)",
    )
    ap.add_argument("--train-only", action="store_true", help="fork and train, then stop (then --resume evaluates)")
    ap.add_argument(
        "--from-empty",
        action="store_true",
        help="SOURCE_RUN is a run name to train first: the system (no evaluator) runs from empty (or resumes) "
        "until it publishes its first co-evolution version, which is then forked",
    )
    ap.add_argument("--warm-up-max-minutes", type=float, default=240.0, help="--from-empty's limit")
    args = ap.parse_args()
    # stopped with SIGTERM, the finally blocks run: a fork's system is stopped (and checkpoints), and the
    # comparison, started tied to this process, stops with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from broker.fork import ForkError, fork_run
    from comap_async.config import load_config

    args.config = str(Path(args.config).resolve())  # the forks and the comparison run from the repository
    cfg = load_config(args.config, args.overrides)
    root = Path(cfg.run.root).expanduser()
    source = Path(args.source) if (Path(args.source) / "replay").is_dir() else root / args.source
    variants = [v for v in args.variants.split(",") if v] + ([args.repeat] if args.repeat else [])
    args.out.mkdir(parents=True, exist_ok=True)
    refuse_bad_variants(args.config, args.overrides, variants)
    warmed = None
    if args.from_empty:
        from comap_async.wire.messages import COEVOLVE

        warmed = run_to_phase(
            source.name,
            COEVOLVE,
            args.config,
            args.overrides,
            args.warm_up_max_minutes,
            args.out,
            root,
            args.out / "source.json",
        )
        print(json.dumps({"warmed_up": source.name, **warmed}), flush=True)
        if args.version is None:
            args.version = warmed["version"]
    ledger = args.out / "forks.json"  # what was forked and trained, so --resume goes on from there
    done = {f["name"]: f for f in json.loads(ledger.read_text())} if args.resume and ledger.exists() else {}

    def save_ledger() -> None:
        ledger.write_text(json.dumps(list(done.values()), indent=2))

    forks: list = []
    replace = frozenset(n for n in args.refork.split(",") if n)
    if replace and not args.resume:
        raise SystemExit("method_table: --refork replaces forks of a table being resumed; add --resume")
    for name, variant, action in plan_forks(variants, source.name, done, replace):
        if action == "keep":
            record = done[name]
        else:
            if action == "refork":
                shutil.rmtree(root / name, ignore_errors=True)
            elif action == "replace":
                print(json.dumps({"replaced": name, "kept_at": str(set_aside(root / name))}), flush=True)
            try:
                record = {"name": name, "variant": variant, **fork_run(source, root / name, args.version)}
            except ForkError as exc:
                hint = "" if args.from_empty else "; --from-empty trains a source from empty first"
                raise SystemExit(f"method_table: {exc} (--resume goes on from {ledger}{hint})") from None
            done[name] = record
            save_ledger()
            print(json.dumps({"forked": name, **{k: record[k] for k in ("version", "step", "phase")}}), flush=True)
        forks.append((name, variant, record))
    for name, variant, record in forks:
        if "wall_s" not in record:
            wall = train(name, variant, args.config, args.overrides, args.minutes, args.out, root / name)
            record["wall_s"] = round(wall)
            save_ledger()
            print(json.dumps({"trained": name, "wall_s": record["wall_s"]}), flush=True)
    if args.train_only:
        print(f"method_table_trained={len(forks)} out={args.out}")
        return
    version = forks[0][2]["version"]
    cmd = compare_command(args, [root / n for n, _, _ in forks], source, version)
    from comap_async.lifetime import tied_env

    rc = subprocess.run(cmd, cwd=ROOT, env=tied_env()).returncode
    if rc != 0:
        raise SystemExit(f"method_table: comap compare stopped with exit {rc} (its error is above); --resume goes on")
    report = json.loads((args.out / "compare.json").read_text())
    head = [
        f"# Method table: {len(forks)} forks of {source.name} at version {version} "
        f"(step {forks[0][2]['step']}, {forks[0][2]['phase']})",
        "",
        *(
            [
                f"- `{source.name}` from empty to its first co-evolution version {warmed['version']} in "
                f"{warmed['wall_s'] / 60:.1f} minutes of wall time (no evaluator running)"
            ]
            if warmed
            else []
        ),
        *[
            f"- `{n}` ({v}): trained {r['wall_s'] / 60:.1f} minutes of wall time{trained_to(root / n, r)}"
            f"{gate_line(gate_by_version(root / n, r['cut_ts']))}"
            for n, v, r in forks
        ],
        "",
    ]
    (args.out / "method_table.md").write_text("\n".join(head) + (args.out / "compare.md").read_text())
    print(f"method_table_rows={len(report['rows'])} out={args.out}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the running system was already stopped (run_system's finally)
        sys.exit("method_table: interrupted; the system it ran is stopped (go on with --resume)")
