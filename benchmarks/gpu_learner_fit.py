"""Does the learner of a GPU config fit the share of the card it is given, and how long is its step?

The GPU configs (configs/alfworld-qwen3-{4b,8b}.yaml) put vLLM and the learner on one card:
`comap procfile` gives vLLM ``--gpu-memory-utilization 0.45`` (``inference.gpu_memory_utilization``),
so the learner has the rest. This builds a random model with the config's model shape (Qwen3-4B or
Qwen3-8B: their published layer sizes, bf16 as ``model.dtype`` says, nothing downloaded), the three
LoRA adapters and the Trainer from the config's ``learner`` section (batch size, sequence cap,
activation checkpointing, autocast, fast path), and trains micro-batches of ``batch_size`` rows of
each kind the learner trains (world-model transitions, demonstrations, reflections) at each
``--prompt-tokens`` length; prompts longer than ``learner.max_seq_len`` are cut as in a run.

    python benchmarks/gpu_learner_fit.py --config configs/alfworld-qwen3-4b.yaml
    python benchmarks/gpu_learner_fit.py --config configs/alfworld-qwen3-8b.yaml --prompt-tokens 1024,4096
    python benchmarks/gpu_learner_fit.py --shape tiny --device cpu    # the script's own smoke test

Peak memory is the allocator's reserved peak (what the card must hold, not only live tensors).
One untimed step first (it allocates the optimizer's state), then one timed micro-batch; a step of
the config is ``grad_accum`` of them. Last line: ``fits=yes|no worst_reserved_gb=X budget_gb=Y``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learner_throughput import OBS  # noqa: E402 - the repo must be on sys.path first

# Qwen3's published configurations (config.json of Qwen/Qwen3-4B and Qwen/Qwen3-8B)
SHAPES = {
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}


def shape_of(model_name: str) -> str:
    name = model_name.lower()
    for shape in ("qwen3-8b", "qwen3-4b"):
        if shape in name:
            return shape
    raise SystemExit(f"no known shape for model {model_name!r}: pass --shape qwen3-4b|qwen3-8b|tiny")


def padded_state(tok, i: int, tokens: int) -> str:
    """A realistic rendered state grown with more history until it has ``tokens`` tokens."""
    from comap_async.prompts import render_state

    history = [("go to countertop 1", OBS), ("take apple 1 from countertop 1", "You pick up the apple 1.")]
    while True:
        s = render_state(
            f"put a clean apple in fridge ({i}).",
            history,
            OBS,
            ["go to fridge 1", "clean apple 1 with sinkbasin 1", "look", "inventory", "examine countertop 1"] * 3,
            k=len(history),
        )
        if len(tok(s)["input_ids"]) >= tokens:
            return s
        history = history + history[-2:]


def micro_batch(tok, n: int, tokens: int) -> dict:
    rows = [padded_state(tok, i, tokens) for i in range(n)]
    nxt = "You arrive at fridge 1. The fridge 1 is closed."
    return {
        "transitions": [
            {"s": s, "a_exec": "go to fridge 1", "s_next": nxt, "s_hat_exec": nxt + " In it, you see a egg 1."}
            for s in rows
        ],
        "demos": [{"s": s, "target": "clean apple 1 with sinkbasin 1"} for s in rows],
        "reflections": [
            {"s": s, "a_draft": "go to fridge 1", "s_bar": nxt, "target": "clean apple 1 with sinkbasin 1", "y": i % 2}
            for i, s in enumerate(rows)
        ],
    }


def budget_gb(cfg, total_gb: float) -> tuple[float, str]:
    if not cfg.shared_gpus():
        return total_gb, "the whole card (no inference server on it)"
    util = cfg.vllm_memory_share()  # what the server on the shared card is given (comap serve, comap procfile)
    return total_gb * (1.0 - util), f"the card less vLLM's {util:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "alfworld-qwen3-4b.yaml"))
    ap.add_argument("--shape", choices=list(SHAPES), help="default: from the config's model.name_or_path")
    ap.add_argument("--prompt-tokens", default="1024,4096", help="comma-separated prompt lengths to train at")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from comap_async.config import load_config
    from comap_async.models import build_tiny_model
    from comap_async.prompts import ChatTemplate, Prompts
    from learner.batches import Encoder
    from learner.peft_model import build_peft_model
    from learner.trainer import Trainer

    cfg = load_config(args.config, [f"learner.device={args.device}"])
    lc = cfg.learner
    shape = args.shape or shape_of(cfg.model.name_or_path)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU host (or --shape tiny --device cpu)")
    torch.manual_seed(0)
    # the tokenizer and chat template of the tiny model: token ids are all the learner's memory sees
    tok_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tok", arch="qwen3")
    prompts = Prompts(ChatTemplate.from_model_dir(tok_dir))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    dtype = getattr(torch, cfg.model.dtype)
    t0 = time.perf_counter()
    with torch.device(args.device):
        base = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **SHAPES[shape]), dtype=dtype)
    base.eval()
    model = build_peft_model(
        base, lc.lora_r, lc.lora_alpha, lc.lora_dropout, lc.target_modules, lc.gradient_checkpointing
    )
    trainer = Trainer(model, Encoder(tok, prompts, lc.max_seq_len), lc, args.device)
    params = sum(p.numel() for p in base.parameters()) / 1e9
    total = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else float("nan")
    budget, why = budget_gb(cfg, total)
    print(
        f"config={Path(args.config).name} shape={shape} params_b={params:.2f} dtype={cfg.model.dtype} "
        f"batch_size={lc.batch_size} grad_accum={lc.grad_accum} max_seq_len={lc.max_seq_len} "
        f"checkpointing={lc.gradient_checkpointing} fast_path={lc.fast_path} autocast={trainer.forward.amp_dtype} "
        f"card_gb={total:.1f} budget_gb={budget:.1f} ({why}) built_s={time.perf_counter() - t0:.1f}",
        flush=True,
    )
    worst, fits = 0.0, True
    for tokens in [int(x) for x in args.prompt_tokens.split(",")]:
        mb = micro_batch(tok, lc.batch_size, tokens)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            trainer.train_step([mb])  # allocates the optimizer's state
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            metrics = trainer.train_step([mb])
            if cuda:
                torch.cuda.synchronize()
            micro_s = time.perf_counter() - t
        except torch.cuda.OutOfMemoryError as e:
            fits = False
            print(f"prompt_tokens={tokens} OOM: {str(e).splitlines()[0]}", flush=True)
            torch.cuda.empty_cache()
            continue
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
        allocated = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        worst = max(worst, reserved)
        fits = fits and (not cuda or reserved <= budget)
        print(
            f"prompt_tokens={tokens} tokens_per_micro_batch={int(metrics['learner/tokens'])} "
            f"truncated={int(metrics['learner/truncated'])} micro_batch_s={micro_s:.2f} "
            f"step_s_estimate={micro_s * lc.grad_accum:.1f} peak_allocated_gb={allocated:.1f} "
            f"peak_reserved_gb={reserved:.1f} losses: "
            + " ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith(("wm/ce", "policy/draft_ce"))),
            flush=True,
        )
    print(f"fits={'yes' if fits else 'no'} worst_reserved_gb={worst:.1f} budget_gb={budget:.1f} shape={shape}")


if __name__ == "__main__":
    main()
