"""Training tokens/s and peak RSS of the learner step (world model CE+KL and policy losses) on
realistic records: the learner as configured (configs/local.yaml: ``learner.autocast``,
``learner.gradient_checkpointing``), and variants of it.

    python benchmarks/learner_throughput.py [--model smollm2-135m-instruct|tiny|DIR] [--steps 3] [--rounds 2]
    python benchmarks/learner_throughput.py --variants new --rounds 1 --steps 1   # quick look
    python benchmarks/learner_throughput.py --qwen3-4b-shape --variants new   # random Qwen3-4B-shaped model, GPU only
    python benchmarks/learner_throughput.py --headline fp32,new --variants fp32,new   # bf16 autocast's gain
    python benchmarks/learner_throughput.py --warmup --headline new,turns --variants new,turns  # env.draft_turns
    python benchmarks/learner_throughput.py --warmup --headline turns,turns-2-threads --variants turns,turns-2-threads
    python benchmarks/learner_throughput.py --warmup --busy 1 --headline turns,turns-2-threads-passive \\
        --variants turns,turns-2-threads,turns-2-threads-passive   # beside a busy core (actors still playing)

``--warmup`` times warm-up SFT's step (demonstrations and transitions without a student rollout,
so no KL; no reflection samples) and
reports demonstrated actions trained per learner hour; ``--headline A,B`` alternates those two variants
round by round and ends with ``speedup`` of B over A (with ``turns``, a variant whose
demonstration records are warm-up paths of ``PATH_TURNS`` actions: ``demos_per_hour_ratio``).
Without ``--headline``, ``new`` runs ``--rounds`` times and the other variants once.

Every variant runs in its own child process (its peak RSS is its own); the two variants of the
headline alternate round by round, so a machine that gets busier or quieter affects both alike.
Each child times ``--steps`` steps after one untimed warm-up step. The same records make the
same training tokens in every variant (the sequences' own lengths), so tokens/s ratios are
step-time ratios. Variants at more than one torch thread are reported apart.

The reference computation this benchmark once compared against (``learner.fast_path: false``,
removed; its figure, 3.86x, is in docs/benchmarks.md) is a test oracle now:
tests/fixtures/reference_path.py.

Last line: ``A_tokens_per_s=X B_tokens_per_s=Y speedup=Z`` with ``--headline``, else
``learner_tokens_per_s=X``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OBS = (
    "You arrive at countertop 1. On the countertop 1, you see a apple 1, a bread 1, a butterknife 2, "
    "a cup 1, a dishsponge 1, a egg 2, a knife 1, a lettuce 1, a mug 2, a peppershaker 1, and a spatula 1."
)

# name -> (learner overrides on top of the config's learner section, torch threads, description)
VARIANTS = {
    "fp32": ({"autocast": "off", "gradient_checkpointing": False}, 1, "in fp32, no checkpointing"),
    "new": ({}, 1, "the learner as configured"),
    "new-2-threads": ({}, 2, "as configured, 2 torch threads (not in the headline)"),
    "new-no-ckpt": ({"gradient_checkpointing": False}, 1, "as configured, without activation checkpointing"),
    "turns": ({}, 1, "as configured, each demonstration record a warm-up path (env.draft_turns)"),
    # the actors idle for most of warm-up, leaving the second core free: a CPU learner then takes every core
    # (learner/threads.py; learner.phases.warmup.torch_threads=2 when this was measured)
    "turns-2-threads": ({}, 2, "turns with 2 torch threads (every core of a 2-core machine, learner/threads.py)"),
    "turns-2-threads-passive": ({}, 2, "the same, idle OpenMP threads sleeping (OMP_WAIT_POLICY=PASSIVE)"),
}
VARIANT_ENV = {"turns-2-threads-passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
"""Environment a variant's child starts with (OpenMP reads it once, when torch loads)."""
BUSY = "import os, sys\nos.nice(5)\nwhile True:\n    pass\n"
"""A process that keeps one core busy at the niceness of actors beside a CPU learner (5): ``--busy``."""
PATH_TURNS = 10  # a turns record's demonstrated actions: valid_seen walkthroughs take 5-40 steps
LOSSES = ("wm/ce", "wm/kl", "policy/draft_ce", "policy/reflect_ce", "policy/bce")


def records(i: int) -> tuple[dict, dict, dict]:
    from comap_async.prompts import render_state

    hist = [
        ("go to countertop 1", OBS),
        ("take apple 1 from countertop 1", "You pick up the apple 1 from the countertop 1."),
        ("go to sinkbasin 1", "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing."),
    ]
    s = render_state(
        "put a clean apple in fridge.",
        hist,
        OBS,
        ["go to fridge 1", "clean apple 1 with sinkbasin 1", "look", "inventory", "examine countertop 1"] * 3,
        k=3,
    )
    wm = {
        "s": s + f" ({i})",
        "a_exec": "go to fridge 1",
        "s_next": "You arrive at fridge 1. The fridge 1 is closed.",
        "s_hat_exec": "You arrive at fridge 1. The fridge 1 is open. In it, you see a egg 1.",
        "o": "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing.",
    }
    demo = {"s": s, "target": "clean apple 1 with sinkbasin 1"}
    refl = {
        "s": s,
        "a_draft": "go to fridge 1",
        "s_bar": "You arrive at fridge 1. The fridge 1 is closed.",
        "target": "clean apple 1 with sinkbasin 1",
        "y": i % 2,
    }
    return wm, demo, refl


def path_record(i: int) -> dict:
    """A warm-up path (``env.draft_turns``) of :data:`PATH_TURNS` demonstrated actions: ALFWorld-like
    observations, long (a receptacle's contents) and short in turn."""
    short = "You pick up the apple 1 from the countertop 1."
    turns = [
        (f"go to countertop {j + 1}" if j % 2 == 0 else "take apple 1 from countertop 1", OBS if j % 2 == 0 else short)
        for j in range(PATH_TURNS)
    ]
    first = (
        "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
        "see a cabinet 1, a cabinet 2, a cabinet 3, a coffeemachine 1, a countertop 1, a countertop 2, a drawer 1, "
        f"a drawer 2, a fridge 1, a garbagecan 1, a microwave 1, a sinkbasin 1, and a toaster 1.\n\nYour task is to: "
        f"put a clean apple in fridge ({i})."
    )
    return {"goal": "put a clean apple in fridge.", "first": first, "turns": turns, "targets": [True] * PATH_TURNS}


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc is missing)."""
    from comap_async.heap import status_gb

    peak = status_gb("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


def learner_config(args: argparse.Namespace, overrides: dict):
    from comap_async.config import LearnerConfig, load_config

    section = load_config(args.config).learner.model_dump()
    return LearnerConfig(**{**section, "batch_size": args.batch_size, "device": args.device, **overrides})


def child(args: argparse.Namespace) -> None:
    """Run one variant: load, one warm-up step, ``--steps`` timed steps; print one RESULT line."""
    import torch

    from comap_async.models import load_model_and_tokenizer, resolve_model
    from comap_async.prompts import ChatTemplate, Prompts
    from learner.batches import Encoder
    from learner.peft_model import build_peft_model
    from learner.trainer import Trainer

    overrides, threads, _ = VARIANTS[args.child]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    path = resolve_model(args.model, args.cache_dir)
    base, tok = load_model_and_tokenizer(path, device=args.device)
    if args.qwen3_4b_shape:
        from transformers import AutoConfig, AutoModelForCausalLM

        from learner.flops import SHAPES

        # the tokenizer's vocabulary, untied as this benchmark's recorded figures were measured
        shape = {**SHAPES["qwen3-4b"], "vocab_size": len(tok), "tie_word_embeddings": False}
        cfg4b = AutoConfig.for_model("qwen3", **shape)
        with torch.device(args.device):  # initialised on the card: a 4B model's CPU init takes a minute
            base = AutoModelForCausalLM.from_config(cfg4b, dtype=torch.bfloat16)
    cfg = learner_config(args, overrides)
    model = build_peft_model(
        base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules, cfg.gradient_checkpointing
    )
    from comap_async.config import load_config

    encoder = Encoder(tok, Prompts(ChatTemplate.from_model_dir(path)), cfg.max_seq_len)
    trainer = Trainer(model, encoder, cfg, args.device, method=load_config(args.config).method)
    rows = [records(i) for i in range(args.batch_size)]
    mb = {"transitions": [r[0] for r in rows], "demos": [r[1] for r in rows], "reflections": [r[2] for r in rows]}
    if args.warmup:  # warm-up SFT's micro-batch: expert transitions carry no student rollout (no KL)
        mb["reflections"] = []
        mb["transitions"] = [{**t, "s_hat_exec": ""} for t in mb["transitions"]]
    if args.child.startswith("turns"):
        mb["demos"] = [path_record(i) for i in range(args.batch_size)]
    # the warm-up step (allocations, lazy init): the adapters' B matrices are still zero, so its
    # losses are the base model's, the same in every variant up to the matmul precision
    first = trainer.train_step([mb])
    tokens, actions, t0 = 0, 0, time.perf_counter()
    for _ in range(args.steps):
        metrics = trainer.train_step([mb])
        tokens += metrics["learner/tokens"]
        actions += metrics["policy/demo_actions"]
    seconds = time.perf_counter() - t0
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 1e9
    else:
        peak = peak_rss_gb()
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens": tokens,
                "demo_actions": actions,
                "seconds": seconds,
                "steps": args.steps,
                "peak_gb": peak,
                "threads": threads,
                "autocast": str(trainer.forward.amp_dtype).replace("torch.", "")
                if trainer.forward.amp_dtype
                else "fp32",
                "checkpointing": cfg.gradient_checkpointing,
                "losses": {k: first[k] for k in LOSSES if k in first},
            }
        ),
        flush=True,
    )


def run_child(args: argparse.Namespace, variant: str) -> dict:
    cmd = (
        [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--model",
            args.model,
            "--cache-dir",
            args.cache_dir,
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            "--device",
            args.device,
            "--config",
            args.config,
        ]
        + (["--qwen3-4b-shape"] if args.qwen3_4b_shape else [])
        + (["--warmup"] if args.warmup else [])
    )
    threads = str(VARIANTS[variant][1])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    env.update(VARIANT_ENV.get(variant, {}))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"variant {variant} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/comap-async/models")
    gpu_shape = "--qwen3-4b-shape" in sys.argv
    ap.add_argument(
        "--config",
        default=str(ROOT / "configs" / ("alfworld-qwen3-4b.yaml" if gpu_shape else "local.yaml")),
        help="its learner section is the variants' (each overrides some of it); default configs/local.yaml "
        "(with --qwen3-4b-shape: alfworld-qwen3-4b.yaml)",
    )
    ap.add_argument("--batch-size", type=int, default=2, help="samples per store (configs/local.yaml: 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per child process")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the headline's variants (alternating)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--device", default="cuda" if gpu_shape else "cpu")
    ap.add_argument("--qwen3-4b-shape", action="store_true", help="random model with Qwen3-4B's shapes (needs a GPU)")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--warmup", action="store_true", help="time warm-up SFT's step (no reflection samples)")
    ap.add_argument("--headline", default="", help="two variants alternated and compared: A,B (default: none)")
    ap.add_argument(
        "--busy", type=int, default=0, help="processes keeping a core busy beside every variant (actors still playing)"
    )
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.qwen3_4b_shape:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--qwen3-4b-shape needs a GPU")
    pair = [v.strip() for v in args.headline.split(",") if v.strip()]
    if args.headline and len(pair) != 2:
        raise SystemExit(f"--headline takes two variants A,B, not {args.headline!r}")
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    wanted += [v for v in pair if v not in wanted]
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    results: dict[str, list[dict]] = {v: [] for v in wanted}
    headline = pair or (["new"] if "new" in wanted else [])
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    try:
        for r in range(args.rounds):  # the headline's two variants alternate; the order flips every round
            for v in headline if r % 2 == 0 else headline[::-1]:
                results[v].append(run_child(args, v))
        for v in wanted:
            if v not in headline:
                results[v].append(run_child(args, v))
    finally:
        for p in busy:
            p.kill()
            p.wait()

    model = "qwen3-4b-shape" if args.qwen3_4b_shape else args.model
    mem = "peak_gpu_gb" if args.device == "cuda" else "peak_rss_gb"
    print(
        f"model={model} device={args.device} batch_size={args.batch_size} steps={args.steps} rounds={args.rounds} "
        f"cpu_count={os.cpu_count()} busy={args.busy}"
    )
    rate, per_hour = {}, {}
    for v in wanted:
        res = results[v]
        tokens, seconds = sum(x["tokens"] for x in res), sum(x["seconds"] for x in res)
        steps = sum(x["steps"] for x in res)
        rate[v] = tokens / seconds
        per_hour[v] = sum(x["demo_actions"] for x in res) * 3600 / seconds
        x = res[0]
        losses = " ".join(f"{k}={val:.4f}" for k, val in x["losses"].items())
        print(
            f"variant={v} tokens_per_s={rate[v]:.1f} step_s={seconds / steps:.2f} tokens_per_step={tokens // steps} "
            f"{mem}={max(y['peak_gb'] for y in res):.2f} threads={x['threads']} precision={x['autocast']} "
            f"checkpointing={x['checkpointing']} runs={len(res)} "
            f"demos_per_hour={per_hour[v]:.0f} first_step: {losses}"
        )
    # what a warm-up path buys is demonstrated actions per hour, not tokens/s
    if any(v.startswith("turns") for v in pair):
        a, b = pair
        print(
            f"{a}_demos_per_hour={per_hour[a]:.0f} {b}_demos_per_hour={per_hour[b]:.0f} "
            f"demos_per_hour_ratio={per_hour[b] / per_hour[a]:.2f}"
        )
    elif pair:
        a, b = pair
        print(f"{a}_tokens_per_s={rate[a]:.1f} {b}_tokens_per_s={rate[b]:.1f} speedup={rate[b] / rate[a]:.2f}")
    elif "new" in rate:
        print(f"learner_tokens_per_s={rate['new']:.1f}")


if __name__ == "__main__":
    main()
