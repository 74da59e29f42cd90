"""Training tokens/s of the learner step (world model CE+KL and policy losses) on realistic records.

    python benchmarks/learner_throughput.py [--model smollm2-135m-instruct|tiny|DIR] [--steps 6]
    python benchmarks/learner_throughput.py --qwen3-4b-shape   # random Qwen3-4B-shaped model, GPU only

Last line: ``learner_tokens_per_s=X``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OBS = ("You arrive at countertop 1. On the countertop 1, you see a apple 1, a bread 1, a butterknife 2, "
       "a cup 1, a dishsponge 1, a egg 2, a knife 1, a lettuce 1, a mug 2, a peppershaker 1, and a spatula 1.")


def records(i: int) -> dict:
    from comap_async.prompts import render_state

    hist = [("go to countertop 1", OBS), ("take apple 1 from countertop 1", "You pick up the apple 1 from the countertop 1."),
            ("go to sinkbasin 1", "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing.")]
    s = render_state("put a clean apple in fridge.", hist, OBS, ["go to fridge 1", "clean apple 1 with sinkbasin 1", "look",
                                                                  "inventory", "examine countertop 1"] * 3, k=3)
    wm = {"s": s + f" ({i})", "a_exec": "go to fridge 1", "s_next": "You arrive at fridge 1. The fridge 1 is closed.",
          "s_hat_exec": "You arrive at fridge 1. The fridge 1 is open. In it, you see a egg 1."}
    demo = {"s": s, "target": "clean apple 1 with sinkbasin 1"}
    refl = {"s": s, "a_draft": "go to fridge 1", "s_bar": "You arrive at fridge 1. The fridge 1 is closed.",
            "target": "clean apple 1 with sinkbasin 1", "y": i % 2}
    return wm, demo, refl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/comap-async/models")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda" if "--qwen3-4b-shape" in sys.argv else "cpu")
    ap.add_argument("--qwen3-4b-shape", action="store_true", help="random model with Qwen3-4B's shapes (needs a GPU)")
    args = ap.parse_args()

    import torch

    from comap_async.config import LearnerConfig
    from comap_async.models import load_model_and_tokenizer, resolve_model
    from comap_async.prompts import ChatTemplate, Prompts
    from learner.batches import Encoder
    from learner.model import build_peft_model
    from learner.trainer import Trainer

    torch.set_num_threads(1)
    path = resolve_model(args.model, args.cache_dir)
    base, tok = load_model_and_tokenizer(path, device=args.device)
    if args.qwen3_4b_shape:
        if not torch.cuda.is_available():
            raise SystemExit("--qwen3-4b-shape needs a GPU")
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg4b = AutoConfig.for_model("qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=len(tok))
        base = AutoModelForCausalLM.from_config(cfg4b, dtype=torch.bfloat16).to(args.device)
    cfg = LearnerConfig(batch_size=args.batch_size, max_seq_len=1024, device=args.device)
    model = build_peft_model(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules,
                             cfg.gradient_checkpointing)
    trainer = Trainer(model, Encoder(tok, Prompts(ChatTemplate.from_model_dir(path)), cfg.max_seq_len), cfg, args.device)
    rows = [records(i) for i in range(args.batch_size)]
    mb = {"transitions": [r[0] for r in rows], "demos": [r[1] for r in rows], "reflections": [r[2] for r in rows]}
    trainer.train_step([mb])  # warm-up (allocations, lazy init)
    rates, t0, tokens = [], time.perf_counter(), 0
    for _ in range(args.steps):
        m = trainer.train_step([mb])
        rates.append(m["learner/tokens_per_s"])
        tokens += m["learner/tokens"]
    dt = time.perf_counter() - t0
    print(f"model={args.model if not args.qwen3_4b_shape else 'qwen3-4b-shape'} device={args.device} "
          f"batch_size={args.batch_size} tokens_per_step={tokens // args.steps} step_s={dt / args.steps:.2f} "
          f"median_step_tokens_per_s={statistics.median(rates):.0f}")
    print(f"learner_tokens_per_s={tokens / dt:.0f}")


if __name__ == "__main__":
    main()
