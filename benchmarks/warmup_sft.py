"""Warm-up SFT of the policy, one learner configuration against another, on the same demonstrations:
demonstrations trained per learner hour, and the held-out draft accuracy after the same number
of them (issue 29, acceptance 3).

    python benchmarks/warmup_sft.py --replay /work/runs/r31/replay --demos 200 --steps 100 \\
        --variants prompt_grad=true,prompt_grad=false --out /tmp/wsft

Each variant trains a fresh policy adapter from the base model (the same seed) on the same
``--demos`` demonstrations read from a run's replay (its ``demos`` store, the expert's steps of
warm-up), ``--steps`` steps of ``learner.batch_size`` in the same order, with the learner section
of ``--config`` plus the variant's ``learner.*`` setting; the world-model adapters stay at the
base model (draft accuracy reads the policy only). Then ``comap eval --probes`` on ``--games``
held-out games reads the draft accuracy (greedy drafts on walkthrough states). The variants train
one after the other in child processes, one torch thread each; run nothing else beside it.

Last line: ``warmup_sft A: demos_per_hour=D draft_accuracy=X ... speedup=S`` (B over A).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_demos(replay: Path, n: int, seed: int) -> list[dict]:
    """``n`` demonstrations of the replay, shuffled with ``seed`` (the same list for every variant)."""
    import msgpack

    from broker.store import ReplayStore
    from comap_async.wire.protocol import STORES

    store = ReplayStore(replay, {s: 1 for s in STORES}, readonly=True)
    try:
        demos = [msgpack.unpackb(raw, raw=False) for raw in store.iter_store("demos")]
    finally:
        store.close()
    if len(demos) < n:
        raise SystemExit(f"{replay} holds {len(demos)} demonstrations, fewer than --demos {n}")
    random.Random(seed).shuffle(demos)
    return [{"s": d["s"], "target": d["target"]} for d in demos[:n]]


def child(args: argparse.Namespace) -> None:
    """Train one variant and save its adapters as version 1 under ``--child-out``; print RESULT."""
    import torch
    import yaml

    from comap_async.config import LearnerConfig
    from comap_async.models import load_model_and_tokenizer, resolve_model
    from comap_async.prompts import ChatTemplate, Prompts
    from comap_async.wire.messages import ROLES, adapter_name
    from learner.batches import Encoder
    from learner.peft_model import build_peft_model
    from learner.publish import save_adapter
    from learner.trainer import Trainer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    section = (yaml.safe_load(Path(args.config).read_text()) or {}).get("learner") or {}
    key, _, value = args.child.partition("=")
    cfg = LearnerConfig(**{**section, "device": "cpu", key: yaml.safe_load(value)})
    path = resolve_model(args.model, args.cache_dir)
    base, tok = load_model_and_tokenizer(path, device="cpu")
    model = build_peft_model(
        base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules, cfg.gradient_checkpointing
    )
    trainer = Trainer(model, Encoder(tok, Prompts(ChatTemplate.from_model_dir(path)), cfg.max_seq_len), cfg, "cpu")
    trainer.scheduler.enter("warmup", 0, args.steps)
    demos = read_demos(Path(args.replay), args.demos, args.seed)
    losses, seconds, trained = [], 0.0, 0
    for step in range(args.steps):
        batch = [demos[(step * cfg.batch_size + i) % len(demos)] for i in range(cfg.batch_size)]
        t0 = time.perf_counter()
        metrics = trainer.train_step([{"demos": batch, "transitions": [], "reflections": []}])
        seconds += time.perf_counter() - t0
        trained += len(batch)
        losses.append(metrics["policy/draft_ce"])
        if step % 10 == 0 or step == args.steps - 1:
            print(f"  {args.child} step {step + 1}/{args.steps} draft_ce={losses[-1]:.3f} {seconds:.0f}s", flush=True)
    out = Path(args.child_out)
    for role in ROLES:
        save_adapter(trainer.model, "policy" if role == "policy" else "wm", out / adapter_name(role, 1))
    first, last = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
    print("RESULT " + json.dumps({"seconds": seconds, "demos": trained, "ce_first10": first, "ce_last10": last}))


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


def probes(args: argparse.Namespace, out: Path) -> dict:
    """``comap eval --probes`` of the variant's version 1: its report."""
    cmd = [
        sys.executable, "-m", "comap_async", "eval", "--config", args.config,
        "--set", f"inference.adapter_root={out / 'adapters'}", *sum((["--set", s] for s in args.eval_overrides), []),
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
    ap.add_argument("--replay", required=True, help="a run's replay directory (its demos store is read)")
    ap.add_argument("--demos", type=int, default=200)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variants", default="prompt_grad=true,prompt_grad=false", help="two learner settings A,B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--games", type=int, default=6, help="held-out games whose walkthrough states are probed")
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--config", default=os.environ.get("COMAP_CONFIG", "configs/local.yaml"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/comap-async/models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-set", dest="eval_overrides", action="append", default=[], help="KEY=VALUE for comap eval")
    ap.add_argument("--resume", action="store_true", help="keep a variant whose probes are already in --out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(variants) != 2 or any("=" not in v for v in variants):
        raise SystemExit(f"--variants takes two learner settings KEY=VALUE,KEY=VALUE, not {args.variants!r}")
    from comap_async.config import LearnerConfig

    for v in variants:
        if v.partition("=")[0] not in LearnerConfig.model_fields:
            raise SystemExit(f"--variants: {v.partition('=')[0]!r} is not a learner setting")
    read_demos(Path(args.replay), args.demos, args.seed)  # refuse a short replay before training anything
    args.argv_common = [
        "--replay", args.replay, "--demos", str(args.demos), "--steps", str(args.steps), "--config", args.config,
        "--model", args.model, "--cache-dir", args.cache_dir, "--seed", str(args.seed), "--out", args.out,
    ]  # fmt: skip
    root = Path(args.out)
    rows = {}
    for v in variants:
        out = root / v.replace("=", "-")
        done = out / "result.json"
        if args.resume and done.exists():
            rows[v] = json.loads(done.read_text())
            continue
        out.mkdir(parents=True, exist_ok=True)
        trained = run_child(args, v, out)
        report = probes(args, out)
        rows[v] = {**trained, "draft_accuracy": report["draft_accuracy"], "states": report["walkthrough_states"]}
        done.write_text(json.dumps(rows[v], indent=1))
    for v, r in rows.items():
        r["demos_per_hour"] = r["demos"] * 3600 / r["seconds"]
        print(
            f"warmup_sft {v}: demos={r['demos']} demos_per_hour={r['demos_per_hour']:.0f} "
            f"draft_ce first10={r['ce_first10']:.3f} last10={r['ce_last10']:.3f} "
            f"draft_accuracy={r['draft_accuracy']:.3f} ({r['states']} held-out states)"
        )
    a, b = variants
    print(
        f"warmup_sft {a} -> {b}: draft_accuracy {rows[a]['draft_accuracy']:.3f} -> {rows[b]['draft_accuracy']:.3f} "
        f"speedup={rows[b]['demos_per_hour'] / rows[a]['demos_per_hour']:.2f}"
    )


if __name__ == "__main__":
    main()
