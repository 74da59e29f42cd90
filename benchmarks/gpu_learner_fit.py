"""Does the learner of a GPU config fit the share of the card it is given, and how long is its step?

The GPU configs (configs/alfworld-qwen3-{4b,8b}.yaml) put vLLM and the learner on one card:
`comap procfile` gives vLLM ``--gpu-memory-utilization 0.45`` (``inference.gpu_memory_utilization``),
so the learner has the rest. This builds a random model with the config's model shape (Qwen3-4B or
Qwen3-8B: their published layer sizes, bf16 as ``model.dtype`` says, nothing downloaded), the three
LoRA adapters and the Trainer from the config's ``learner`` section (batch size, sequence cap,
activation checkpointing, autocast), and trains micro-batches of ``batch_size`` rows of
each kind the learner trains (world-model transitions, demonstrations, reflections) at each
``--prompt-tokens`` length; prompts longer than ``learner.max_seq_len`` are cut as in a run.

    python benchmarks/gpu_learner_fit.py --config configs/alfworld-qwen3-4b.yaml
    python benchmarks/gpu_learner_fit.py --config configs/alfworld-qwen3-8b.yaml --prompt-tokens 1024,4096
    python benchmarks/gpu_learner_fit.py --shape tiny --device cpu    # the script's own smoke test

Peak memory is the allocator's reserved peak (what the card must hold, not only live tensors).
One untimed step first (it allocates the optimizer's state), then one timed micro-batch; a step of
the config is ``grad_accum`` of them. Last line: ``fits=yes|no worst_reserved_gb=X budget_gb=Y``.

**Model FLOPs utilisation** (``--mfu``): each timed step's model FLOPs (learner/flops.py: ``4N`` per
trained token of the frozen base, ``12 L d_attn T`` of attention, the adapters and the projected head;
real tokens only) against the card's dense bf16 peak (a table keyed by the device's name, or
``--peak-tflops``). ``--lengths-from RUN`` adds a step of ``grad_accum`` micro-batches drawn from that
run's replay (its records' real lengths, packed as the learner packs them). Last lines, at the longest
``--prompt-tokens`` (4096: the config's cap): ``tokens_per_s=X ...`` then ``mfu=Y ...``.

    python benchmarks/gpu_learner_fit.py --config configs/alfworld-qwen3-4b.yaml --mfu
    python benchmarks/gpu_learner_fit.py --mfu --lengths-from runs/NAME --set learner.gradient_checkpointing=false
    python benchmarks/gpu_learner_fit.py --cpu-padding-only --lengths-from runs/NAME   # no GPU, no model

``--cpu-padding-only`` runs nothing on a model: it builds the same micro-batches and prints their
padding share (padded positions / all positions of the packed rows), real tokens per optimizer step
and model FLOPs per step, and the step time those FLOPs take at 40 % of an H100's peak.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.learner_throughput import OBS  # noqa: E402 - the repo must be on sys.path first
from learner.flops import (  # noqa: E402
    SHAPES,
    ModelDims,
    Pass,
    card_peak_tflops,
    flops_per_token,
    mfu,
    micro_batch_passes,
    padding,
    pass_flops,
)


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


H100_PEAK_TFLOPS = 989.0
TARGET_MFU = 0.40  # the goal for the 4B shape on an H100


def tokenizer_dir(choice: str, cfg: Any, shape: str) -> Path:
    """The tokenizer and chat template prompts are counted in. ``auto``: the config's model where the
    local cache has it, else the prepared default model (SmolLM2, closer to Qwen3's token counts than the
    tiny model's 512-token vocabulary), else the tiny model's; ``tiny``; or a directory. Nothing is
    downloaded."""
    from comap_async.models import DEFAULT_MODEL, ModelError, build_tiny_model, resolve_model

    if choice == "tiny" or (choice == "auto" and shape == "tiny"):
        return build_tiny_model(Path(tempfile.mkdtemp()) / "tok", arch="qwen3")
    if choice != "auto":
        return Path(choice)
    for name in (cfg.model.name_or_path, DEFAULT_MODEL):
        try:
            return Path(resolve_model(name, cfg.model.cache_dir, prepare_tiny=False))
        except ModelError:
            continue
    return build_tiny_model(Path(tempfile.mkdtemp()) / "tok", arch="qwen3")


def replay_records(run: Path) -> dict[str, list[dict]]:
    """A run's stored transitions, demonstrations and reflection samples, as the broker serves them;
    only co-evolution's transitions where the run has any (what co-evolution trains the world model on)."""
    from broker.ingest import record_from_store
    from broker.store import ReplayStore
    from comap_async.wire.messages import COEVOLVE
    from comap_async.wire.protocol import STORES

    replay = run / "replay" if (run / "replay").is_dir() else run
    if not (replay / "data.mdb").is_file():
        raise SystemExit(f"--lengths-from {run}: no replay there (neither {run}/replay/data.mdb nor {run}/data.mdb)")
    store = ReplayStore(replay, {s: 1 for s in STORES}, readonly=True)
    try:
        kinds = ("transitions", "demos", "reflections")
        pools = {n: [record_from_store(n, raw) for raw in store.iter_store(n)] for n in kinds}
    finally:
        store.close()
    coevolve = [r for r in pools["transitions"] if r.get("phase") == COEVOLVE]
    pools["transitions"] = coevolve or pools["transitions"]
    if not any(pools.values()):
        raise SystemExit(f"--lengths-from {run}: its replay holds no transitions, demonstrations or reflections")
    return pools


def replay_micro_batches(pools: dict[str, list[dict]], n: int, batch_size: int, seed: int) -> list[dict]:
    """``n`` micro-batches of ``batch_size`` records of each non-empty store, drawn uniformly (with
    replacement: a short run's replay may hold fewer records than a step trains)."""
    rng = random.Random(seed)
    return [{k: [rng.choice(pool) for _ in range(batch_size)] for k, pool in pools.items() if pool} for _ in range(n)]


def step_passes(trainer: Any, micro_batches: list[dict]) -> list[Pass]:
    return [p for mb in micro_batches for p in micro_batch_passes(trainer, mb)]


def describe(passes: list[Pass], dims: ModelDims, grad_accum_factor: int) -> dict[str, Any]:
    """Padding, real tokens and model FLOPs of a step made of ``passes`` (``grad_accum_factor`` times)."""
    pad = padding(passes)
    lengths = [n for p in passes for n in p.lengths]
    return {
        "padding_share": pad.share,
        "padding_share_unpacked": pad.dense_share,
        "tokens": pad.real * grad_accum_factor,
        "trained_tokens": sum(sum(p.lengths) for p in passes if p.backward) * grad_accum_factor,
        "flops": sum(pass_flops(p, dims) for p in passes) * grad_accum_factor,
        "unit_len_mean": sum(lengths) / max(len(lengths), 1),
        "unit_len_max": max(lengths, default=0),
        "passes": len(passes) * grad_accum_factor,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "alfworld-qwen3-4b.yaml"))
    ap.add_argument("--shape", choices=list(SHAPES), help="default: from the config's model.name_or_path")
    ap.add_argument("--prompt-tokens", default="1024,4096", help="comma-separated prompt lengths to train at")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (a lever)")
    ap.add_argument("--mfu", action="store_true", help="print tokens/s and MFU (last lines)")
    ap.add_argument("--lengths-from", type=Path, metavar="RUN", help="a run directory (or its replay): real lengths")
    ap.add_argument("--micro-batches", type=int, help="micro-batches of --lengths-from's step (default grad_accum)")
    ap.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (default: by the device's name)")
    ap.add_argument("--tokenizer", default="auto", help="auto | tiny | a model directory (see tokenizer_dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-padding-only",
        action="store_true",
        help="no model run: padding share, tokens and model FLOPs per step of the config's batch",
    )
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from comap_async.config import load_config
    from comap_async.prompts import ChatTemplate, Prompts
    from learner.batches import Encoder
    from learner.peft_model import adapter_parameters, build_peft_model
    from learner.trainer import Trainer

    if args.cpu_padding_only:
        args.device = "cpu"
    cfg = load_config(args.config, [f"learner.device={args.device}", *args.set])
    lc = cfg.learner
    shape = args.shape or shape_of(cfg.model.name_or_path)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU host (or --shape tiny --device cpu, or --cpu-padding-only)")
    if (args.mfu or args.cpu_padding_only) and lc.policy_wm_aux > 0:
        raise SystemExit("the FLOPs count follows the learner's step without policy_wm_aux")
    pools = replay_records(args.lengths_from) if args.lengths_from else None  # fails before the model is built
    torch.manual_seed(0)
    tok_dir = tokenizer_dir(args.tokenizer, cfg, shape)
    prompts = Prompts(ChatTemplate.from_model_dir(tok_dir))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    if len(tok) > SHAPES[shape]["vocab_size"]:
        raise SystemExit(f"tokenizer {tok_dir} has {len(tok)} tokens, more than the {shape} shape's vocabulary")
    dims = ModelDims.from_shape(SHAPES[shape], lc.lora_r)
    dtype = getattr(torch, cfg.model.dtype)
    t0 = time.perf_counter()
    # --cpu-padding-only: a Trainer of the tiny shape encodes and lays out the batches as the config's
    # learner does (the units depend on the tokenizer and learner section only, not on the weights)
    with torch.device(args.device):
        built = "tiny" if args.cpu_padding_only else shape
        base = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **SHAPES[built]), dtype=dtype)
    base.eval()
    params = sum(p.numel() for p in base.parameters()) / 1e9
    # the decoder's matmul weights counted on the model itself, before LoRA wraps its linear layers
    matmul_params = sum(m.weight.numel() for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear))
    model = build_peft_model(
        base, lc.lora_r, lc.lora_alpha, lc.lora_dropout, lc.target_modules, lc.gradient_checkpointing
    )
    trainer = Trainer(model, Encoder.for_learner(tok, prompts, lc), lc, args.device, method=cfg.method)
    if not args.cpu_padding_only:  # the model's own counts, where the config's shape was built
        lora = sum(p.numel() for _, p in adapter_parameters(model, "policy"))
        dims = ModelDims(dims.layers, dims.hidden, dims.attn_width, dims.vocab, matmul_params, lora)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else float("nan")
    budget, why = budget_gb(cfg, total)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or card_peak_tflops(name)
    print(
        f"config={Path(args.config).name} shape={shape} "
        f"params_b={'not built' if args.cpu_padding_only else f'{params:.2f}'} dtype={cfg.model.dtype} "
        f"batch_size={lc.batch_size} grad_accum={lc.grad_accum} max_seq_len={lc.max_seq_len} "
        f"checkpointing={lc.gradient_checkpointing} autocast={trainer.forward.amp_dtype} "
        f"chunk_tokens={lc.chunk_tokens} card_gb={total:.1f} budget_gb={budget:.1f} ({why}) device={name!r} "
        f"peak_tflops={peak} tokenizer={tok_dir} decoder_matmul_params_b={dims.params / 1e9:.3f} "
        f"lora_params_m={dims.lora_params / 1e6:.2f} built_s={time.perf_counter() - t0:.1f}",
        flush=True,
    )
    settings: list[tuple[str, list[dict], int]] = []  # (label, the step's micro-batches, times they repeat)
    for tokens in [int(x) for x in args.prompt_tokens.split(",")]:
        # one micro-batch built and timed; the config's step is grad_accum of them
        settings.append((f"prompt_tokens={tokens}", [micro_batch(tok, lc.batch_size, tokens)], lc.grad_accum))
    if pools is not None:
        n = args.micro_batches or lc.grad_accum
        mbs = replay_micro_batches(pools, n, lc.batch_size, args.seed)
        held = " ".join(f"{k}={len(v)}" for k, v in pools.items())
        settings.append((f"lengths_from={args.lengths_from} ({held})", mbs, 1))  # the step as drawn

    if args.cpu_padding_only:
        return padding_report(trainer, settings, dims)
    worst, fits, results = 0.0, True, []
    for label, mbs, repeat in settings:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            trainer.train_step(mbs)  # allocates the optimizer's state
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            metrics = trainer.train_step(mbs)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t
        except torch.cuda.OutOfMemoryError as e:
            fits = False
            print(f"{label} OOM: {str(e).splitlines()[0]}", flush=True)
            torch.cuda.empty_cache()
            continue
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
        allocated = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        worst = max(worst, reserved)
        fits = fits and (not cuda or reserved <= budget)
        print(
            f"{label} tokens_per_micro_batch={int(metrics['learner/tokens']) // len(mbs)} "
            f"truncated={int(metrics['learner/truncated'])} micro_batch_s={seconds / len(mbs):.2f} "
            f"step_s_estimate={seconds * repeat:.1f} peak_allocated_gb={allocated:.1f} "
            f"peak_reserved_gb={reserved:.1f} losses: "
            + " ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith(("wm/ce", "policy/draft_ce"))),
            flush=True,
        )
        if args.mfu:
            d = describe(step_passes(trainer, mbs), dims, 1)
            results.append((label, d, seconds, metrics["learner/tokens"]))
    print(f"fits={'yes' if fits else 'no'} worst_reserved_gb={worst:.1f} budget_gb={budget:.1f} shape={shape}")
    if args.mfu:
        mfu_report(results, peak, name)


def padding_report(trainer: Any, settings: list[tuple[str, list[dict], int]], dims: ModelDims) -> None:
    """``--cpu-padding-only``: each setting's step laid out, nothing run."""
    lc = trainer.cfg
    last = None
    for label, mbs, repeat in settings:
        passes = step_passes(trainer, mbs)
        d = describe(passes, dims, repeat)
        h100_s = d["flops"] / (TARGET_MFU * H100_PEAK_TFLOPS * 1e12)
        kinds = " ".join(
            f"{k}:{sum(len(p.lengths) for p in passes if p.name == k) * repeat}" for k in ("wm_teacher", "wm", "policy")
        )
        print(
            f"{label} micro_batches_per_step={len(mbs) * repeat} units_per_step={kinds} "
            f"unit_len_mean={d['unit_len_mean']:.0f} unit_len_max={d['unit_len_max']} "
            f"padding_share={d['padding_share']:.4f} padding_share_unpacked={d['padding_share_unpacked']:.4f} "
            f"tokens_per_step={d['tokens']} trained_tokens_per_step={d['trained_tokens']} "
            f"model_tflops_per_step={d['flops'] / 1e12:.1f} step_s_at_{TARGET_MFU:.0%}_mfu_h100={h100_s:.1f} "
            f"flops_per_trained_token_at_max_seq_len={flops_per_token(dims, lc.max_seq_len) / 1e9:.1f}G",
            flush=True,
        )
        last = (label, d)
    label, d = last
    print(f"padding_share={d['padding_share']:.4f} tokens_per_step={d['tokens']} setting={label}")


def mfu_report(results: list[tuple[str, dict, float, float]], peak: float | None, name: str) -> None:
    """Per setting, then the headline: the longest --prompt-tokens setting (4096, the config's cap)."""
    if not results:
        print("mfu=failed: no setting ran")
        return
    for label, d, seconds, learner_tokens in results:
        util = f"{mfu(d['flops'], seconds, peak):.4f}" if peak else "unknown"
        print(
            f"mfu_setting {label} step_s={seconds:.2f} tokens_per_s={d['tokens'] / seconds:.0f} "
            f"trained_tokens_per_s={d['trained_tokens'] / seconds:.0f} "
            f"learner_tokens_per_s={learner_tokens / seconds:.0f} "
            f"model_tflops={d['flops'] / 1e12:.1f} achieved_tflops={d['flops'] / seconds / 1e12:.1f} mfu={util} "
            f"padding_share={d['padding_share']:.4f}",
            flush=True,
        )
    fixed = [r for r in results if r[0].startswith("prompt_tokens=")]
    label, d, seconds, _ = max(fixed or results, key=lambda r: r[1]["unit_len_max"])
    print(f"tokens_per_s={d['tokens'] / seconds:.0f} padding_share={d['padding_share']:.4f} setting={label}")
    if peak:
        print(f"mfu={mfu(d['flops'], seconds, peak):.4f} peak_tflops={peak} gpus=1 device={name!r} setting={label}")
    else:
        print(f"mfu=unknown: no peak for device {name!r} (pass --peak-tflops) setting={label}")


if __name__ == "__main__":
    main()
