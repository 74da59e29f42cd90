"""One learner setting against another on the same stored samples of a run: samples trained per
learner hour, then the held-out probes of each trained policy (a faster
learner is kept only if it learns as well from the same data).

    python experiments/studies/learner_setting.py --replay runs/NAME/replay --samples 200 --steps 100 \
        --variants KEY=VALUE,KEY=VALUE --out OUT                                  # warm-up SFT
    python experiments/studies/learner_setting.py --phase reflect_init --init-adapter DIR/policy-v1 ...  # reflect init

Each variant trains the policy adapter (from the base model, or from ``--init-adapter``, a peft
adapter directory such as an end-of-warm-up ``policy-vN``) with the same seed on the same
``--samples`` samples of the run's replay, ``--steps`` steps in the same order, with the learner
section of ``--config`` plus the variant's ``learner.*`` settings (``KEY=VALUE``, several joined by
``+``). ``--phase warmup``: a step is
``learner.batch_size`` demonstrations (warm-up SFT's draft loss; the world model, which the
draft accuracy does not read, is left at the base model). ``--phase reflect_init``: a step is
``learner.phases.reflect_init.batch_size`` suffix-labelled reflection samples and ``learner.batch_size``
demonstrations (reflection-mode initialisation's micro-batch and losses). Then ``comap eval
--probes`` on ``--games`` held-out games: draft accuracy, and for ``reflect_init`` how ``p``
ranks wrong drafts above right ones (``p_auc``, discrimination) and unreadable reflections. The
variants train one after the other in child processes, one torch thread each; run nothing else
beside it if the speed is to be read.

``--same-actions`` (warm-up: the draft's two prompt forms on identical demonstrations): the samples
are the replay's walkthrough paths (``turn_demos`` records, a run in a turns prompt form, ``env.prompt_form``), shuffled
and taken until their demonstrated actions reach ``--samples``; a variant with ``env.prompt_form=window``
trains the same actions as window-form demonstrations (each step's warm-up transition ``(s, a_exec)``:
what the broker stores as a demonstration in that form).
A variant's settings reach its probes too (``env.*`` render their prompts). ``--epochs E`` sizes each
variant's own steps (``ceil(E * samples / batch_size)``, its learning-rate schedule with them) instead
of ``--steps``:

    python experiments/studies/learner_setting.py --replay runs/NAME/replay --same-actions --samples 240 \
        --epochs 1 --variants env.prompt_form=window+demo_loss_share={},env.prompt_form=draft_turns --out OUT

Last line: ``learner_setting A -> B: draft_accuracy X -> Y [p_auc ...] speedup=S`` (B's samples per
hour over A's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from comap_async.wire.messages import REFLECT_INIT, WARMUP  # noqa: E402

PROBE_FIGURES = {
    WARMUP: ("draft_accuracy",),
    REFLECT_INIT: ("draft_accuracy", "p_auc", "p_discrimination", "reflection_problem_rate", "gate_open_rate"),
}


def read_store(replay: Path, store_name: str, n: int | None, seed: int, keep: Any = None) -> list[dict]:
    """``n`` records of one store of the replay (all if None), as the broker serves them to the
    learner, that ``keep`` accepts, shuffled with ``seed``: the same list for every variant."""
    from broker.ingest import record_from_store
    from broker.store import ReplayStore
    from comap_async.wire.protocol import STORES

    store = ReplayStore(replay, {s: 1 for s in STORES}, readonly=True)
    try:
        records = [record_from_store(store_name, raw) for raw in store.iter_store(store_name)]
    finally:
        store.close()
    records = [r for r in records if keep is None or keep(r)]
    if n is not None and len(records) < n:
        raise SystemExit(f"{replay} holds {len(records)} {store_name} samples to train, fewer than --samples {n}")
    random.Random(seed).shuffle(records)
    return records if n is None else records[:n]


def is_suffix(record: dict) -> bool:
    return record.get("source") == "suffix"


def recovery_demos(records: list[dict], mode: str) -> list[dict]:
    """The demonstrations with their recovery paths as ``--recovery`` says: ``stored`` as the actors
    sent them (the expert's prefix and the recovery action all carry a loss), ``none`` left out,
    ``last`` with a loss on the recovery action alone (the prefix is the main path's, trained there)."""
    if mode == "stored":
        return records
    if mode == "none":
        return [r for r in records if not r.get("recovery")]
    return [recovery_last(r) if r.get("recovery") and "turns" in r else r for r in records]


def recovery_last(record: dict) -> dict:
    targets = [False] * len(record["targets"])
    targets[-1] = bool(record["targets"][-1])
    return {**record, "targets": targets}


def demonstrated_actions(record: dict) -> int:
    return sum(map(bool, record["targets"])) if "turns" in record else 1


def walkthrough_paths(replay: Path, actions: int, seed: int) -> list[dict]:
    """``--same-actions``: the replay's walkthrough paths (neither recovery branches nor imagined),
    shuffled with ``seed``, taken until their demonstrated actions reach ``actions``."""
    paths = [r for r in read_store(replay, "demos", None, seed) if "turns" in r]
    paths = [r for r in paths if not r.get("recovery") and not r.get("imagined")]
    out, held = [], 0
    for path in paths:
        if held >= actions:
            break
        out.append(path)
        held += demonstrated_actions(path)
    if held < actions:
        raise SystemExit(
            f"{replay} holds {len(paths)} walkthrough paths of {held} demonstrated actions, fewer than --samples "
            f"{actions} (--same-actions reads the turn_demos of a run with env.prompt_form draft_turns or all_turns)"
        )
    return out


def window_demos(replay: Path, paths: list[dict], seed: int) -> list[dict]:
    """The demonstrated actions of ``paths`` as the window form stores them: per action, its step's
    warm-up transition's ``(s, a_exec)`` (the explore and recovery transitions beside it left out),
    shuffled with ``seed``."""
    wanted = {p["episode"]: p for p in paths}
    steps: dict[tuple[str, int], dict] = {}
    for tr in read_store(replay, "transitions", None, seed):
        on_path = tr.get("phase") == WARMUP and not tr.get("explore") and not tr.get("recovery")
        if on_path and tr.get("episode") in wanted:
            steps[(tr["episode"], int(tr["t"]))] = tr
    demos = []
    for episode, path in wanted.items():
        for t, ((action, _), target) in enumerate(zip(path["turns"], path["targets"], strict=True)):
            tr = steps.get((episode, t))
            if tr is None or tr["a_exec"] != action:
                raise SystemExit(f"{replay}: episode {episode}'s step {t} ({action!r}) has no warm-up transition")
            if target:
                demos.append({"id": tr["id"], "game": tr["game"], "goal": tr["goal"], "s": tr["s"], "target": action})
    random.Random(seed).shuffle(demos)
    return demos


def training_data(args: argparse.Namespace, turns: bool = True) -> tuple[list[dict], list[dict]]:
    """(demonstrations, reflection samples) the phase trains: ``--samples`` of its own kind
    (``--same-actions``: paths, or with ``turns`` false their actions in the window form)."""
    replay = Path(args.replay)
    if args.same_actions:
        paths = walkthrough_paths(replay, args.samples, args.seed)
        return (paths if turns else window_demos(replay, paths, args.seed)), []
    if args.phase == WARMUP:
        # shuffled before the recovery paths are chosen: --recovery stored reads what read_store(n) would
        demos = recovery_demos(read_store(replay, "demos", None, args.seed), args.recovery)
        if len(demos) < args.samples:
            with_recovery = "" if args.recovery == "stored" else f" with --recovery {args.recovery}"
            raise SystemExit(
                f"{replay} holds {len(demos)} demos samples to train{with_recovery}, "
                f"fewer than --samples {args.samples}"
            )
        return demos[: args.samples], []
    return read_store(replay, "demos", None, args.seed), read_store(
        replay, "reflections", args.samples, args.seed, is_suffix
    )


def child(args: argparse.Namespace) -> None:
    """Train one variant and save its adapters as version 1 under ``--child-out``; print RESULT."""
    import torch

    from comap_async.method.phases import phase_spec
    from comap_async.wire.messages import ROLES, adapter_name
    from experiments.studies.reflect_discrimination import build_trainer
    from learner.publish import save_adapter

    torch.set_num_threads(1)
    cfg = variant_config(args, args.child)
    lc = cfg.learner
    demos, reflections = training_data(args, cfg.env.draft_turns)
    n_refl = phase_spec(lc, REFLECT_INIT).batch_size if args.phase == REFLECT_INIT else 0
    steps = args.steps if args.epochs is None else math.ceil(args.epochs * len(demos) / lc.batch_size)
    trainer = build_trainer(cfg, Path(args.init_adapter) if args.init_adapter else None, {}, steps, args.phase)
    losses, seconds, trained = [], 0.0, 0
    loss_name = "policy/draft_ce" if args.phase == WARMUP else "policy/loss"
    for step in range(steps):
        mb = {
            "demos": [demos[(step * lc.batch_size + i) % len(demos)] for i in range(lc.batch_size)],
            "reflections": [reflections[(step * n_refl + i) % len(reflections)] for i in range(n_refl)],
            "transitions": [],
        }
        t0 = time.perf_counter()
        metrics = trainer.train_step([mb])
        seconds += time.perf_counter() - t0
        trained += len(mb["reflections"]) if n_refl else sum(map(demonstrated_actions, mb["demos"]))
        losses.append(metrics[loss_name])
        if step % 10 == 0 or step == steps - 1:
            print(f"  {args.child} step {step + 1}/{steps} {loss_name}={losses[-1]:.3f} {seconds:.0f}s", flush=True)
    out = Path(args.child_out)
    for role in ROLES:
        save_adapter(trainer.model, "policy" if role == "policy" else "wm", out / adapter_name(role, 1))
    first, last = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
    result = {"seconds": seconds, "samples": trained, "steps": steps, "loss_first10": first, "loss_last10": last}
    print("RESULT " + json.dumps(result))


def model_overrides(args: argparse.Namespace) -> list[str]:
    """``--model`` and ``--cache-dir`` as config overrides (training and probes alike); none: the config's."""
    out = []
    if args.model:
        out.append(f"model.name_or_path={args.model}")
    if args.cache_dir:
        out.append(f"model.cache_dir={args.cache_dir}")
    return out


def variant_settings(variant: str) -> list[str]:
    """A variant's overrides: ``KEY=VALUE`` parts joined by ``+``, a learner key unless it names the
    ``env`` or the ``method`` section (``env.prompt_form=window``, ``method.bce_balance=true``)."""
    return [part if part.startswith(("env.", "method.")) else f"learner.{part}" for part in variant.split("+")]


def variant_config(args: argparse.Namespace, variant: str) -> Any:
    """``--config`` with the variant's settings (:func:`variant_settings`), loaded and checked as a
    run's config is."""
    from comap_async.config import ConfigError, load_config

    settings = variant_settings(variant)
    try:
        return load_config(args.config, [*settings, *model_overrides(args), f"run.seed={args.seed}"])
    except ConfigError as exc:
        raise SystemExit(f"--variants {variant}: {exc}") from None


def run_child(args: argparse.Namespace, variant: str, out: Path) -> dict:
    cmd = [sys.executable, __file__, *args.argv_common, "--child", variant, "--child-out", str(out / "adapters")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = None
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
        for line in proc.stdout:  # the child's progress as it trains
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            else:
                print(line, end="", flush=True)
        proc.wait()
    if result is None:
        raise SystemExit(f"variant {variant} failed (exit {proc.returncode}); see {out / 'train.log'}")
    return result


def probes(args: argparse.Namespace, variant: str, out: Path) -> dict:
    """``comap eval --probes`` of the variant's version 1 under the variant's settings (its ``env.*`` ones
    render the probes' prompts; the learner's are there so the config checks as it did in training): its report."""
    cmd = [
        sys.executable, "-m", "comap_async", "eval", "--config", args.config,
        "--set", f"inference.adapter_root={out / 'adapters'}",
        *sum((["--set", s] for s in [*model_overrides(args), *variant_settings(variant), *args.eval_overrides]), []),
        "--adapters", "1", "--probes", "--split", args.split, "--games", str(args.games),
        "--serve", "always", "--out", str(out / "eval"),
    ]  # fmt: skip
    with open(out / "eval.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"comap eval failed (exit {proc.returncode}); see {out / 'eval.log'}")
    return json.loads((out / "eval" / "eval.json").read_text())["probes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", required=True, help="a run's replay directory (its stores are read)")
    ap.add_argument("--phase", choices=list(PROBE_FIGURES), default=WARMUP)
    ap.add_argument("--samples", type=int, default=200, help="demonstrations (warmup) or suffix reflections")
    ap.add_argument(
        "--recovery",
        choices=["stored", "none", "last"],
        default="stored",
        help="warm-up's recovery paths: as stored, left out, or a loss on the recovery action alone",
    )
    ap.add_argument("--init-adapter", help="a policy adapter directory to start from (default: the base model)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--epochs", type=float, help="each variant's steps: this many passes over its samples")
    ap.add_argument(
        "--same-actions",
        action="store_true",
        help="warm-up on the replay's walkthrough paths, each variant in its own prompt form (--samples: actions)",
    )
    ap.add_argument("--variants", default="", help="two learner settings A,B (required)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--games", type=int, default=6, help="held-out games whose walkthrough states are probed")
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--config", default=os.environ.get("COMAP_CONFIG", "configs/local.yaml"))
    ap.add_argument("--model", help="model.name_or_path for training and probes (default: the config's)")
    ap.add_argument("--cache-dir", help="model.cache_dir (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-set", dest="eval_overrides", action="append", default=[], help="KEY=VALUE for comap eval")
    ap.add_argument("--resume", action="store_true", help="keep a variant whose probes are already in --out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(variants) != 2:
        raise SystemExit(
            f"--variants takes two learner settings A,B (each KEY=VALUE[+KEY=VALUE]), not {args.variants!r}"
        )
    # a setting the config refuses stops here, before any training
    forms = {variant_config(args, v).env.draft_turns for v in variants}
    if args.init_adapter and not (Path(args.init_adapter) / "adapter_model.safetensors").is_file():
        raise SystemExit(f"--init-adapter {args.init_adapter}: no adapter_model.safetensors there")
    if args.same_actions and args.phase != WARMUP:
        raise SystemExit("--same-actions compares warm-up's demonstrations: it needs --phase warmup")
    if args.epochs is not None and args.epochs <= 0:
        raise SystemExit(f"--epochs {args.epochs}: a positive number of passes")
    for turns in forms:  # refuse a short replay (--same-actions: a path step without its transition) before training
        training_data(args, turns)
    args.argv_common = [
        "--replay", args.replay, "--phase", args.phase, "--samples", str(args.samples), "--steps", str(args.steps),
        "--recovery", args.recovery, *(["--epochs", str(args.epochs)] if args.epochs is not None else []),
        *(["--same-actions"] if args.same_actions else []),
        *(["--init-adapter", args.init_adapter] if args.init_adapter else []), "--config", args.config,
        *(["--model", args.model] if args.model else []), *(["--cache-dir", args.cache_dir] if args.cache_dir else []),
        "--seed", str(args.seed), "--out", args.out,
    ]  # fmt: skip
    root = Path(args.out)
    rows = {}
    for v in variants:
        out = root / v.replace("=", "-").replace("+", "_")
        done = out / "result.json"
        if args.resume and done.exists():
            rows[v] = json.loads(done.read_text())
            continue
        out.mkdir(parents=True, exist_ok=True)
        trained = run_child(args, v, out)
        report = probes(args, v, out)
        rows[v] = {
            **trained,
            **{k: report.get(k) for k in PROBE_FIGURES[args.phase]},
            "states": report["walkthrough_states"],
        }
        done.write_text(json.dumps(rows[v], indent=1))

    def fig(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    for v, r in rows.items():
        r["per_hour"] = r["samples"] * 3600 / r["seconds"]
        figures = " ".join(f"{k}={fig(r.get(k))}" for k in PROBE_FIGURES[args.phase])
        print(
            f"learner_setting {args.phase} {v}: samples={r['samples']} per_hour={r['per_hour']:.0f} "
            f"loss first10={r['loss_first10']:.3f} last10={r['loss_last10']:.3f} {figures} "
            f"({r['states']} held-out states)"
        )
    a, b = variants
    change = " ".join(f"{k} {fig(rows[a].get(k))} -> {fig(rows[b].get(k))}" for k in PROBE_FIGURES[args.phase])
    print(f"learner_setting {a} -> {b}: {change} speedup={rows[b]['per_hour'] / rows[a]['per_hour']:.2f}")


if __name__ == "__main__":
    main()
