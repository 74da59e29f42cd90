"""Where a decode step of the embedded server goes, with the real default model, in-process, one thread.

A batch of 8 rows with ``--context`` tokens of KV cache each; every figure is the median of
``--steps`` timed runs, in milliseconds per decode step (and per token for prefill):

* ``step``: one whole forward (fused: ``FusedLlama.forward``; reference: transformers + peft stacks);
* ``weights``: the step's GEMMs alone (every projection of every layer and the LM head), i.e.
  streaming the weights; ``weights_gb_per_s`` is the rate they are read at;
* ``attention``: the fused attention over the KV cache alone, all layers;
* ``lora_1`` / ``lora_4``: what one adapter on every row / four adapters plus the base in one batch
  add to the step;
* ``sampling``: ``sample_step`` for 8 rows at temperature 0.7 (top-p 1) with logprobs;
  ``sampling_top_p``: the same at top-p 0.9 (the actors' setting), from the top 256 candidates (both
  sides: sampling does not depend on the forward);
* ``rest``: step - weights - attention (norms, rotary, casts, cache writes, Python dispatch).

    python benchmarks/decode_breakdown.py [--context 300] [--steps 15]

Last line: ``fused_step_ms=X reference_step_ms=Y step_speedup=Z``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inference import fused_setup  # noqa: E402

from comap_async.config import load_config  # noqa: E402
from comap_async.inference.adapters import BASE  # noqa: E402
from comap_async.inference.fused import attend, attention_bias  # noqa: E402
from comap_async.inference.kvcache import BatchCache  # noqa: E402
from comap_async.inference.token_sampling import SamplingParams, sample_step  # noqa: E402

B = 8


def median_ms(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


class Stepper:
    """Decode steps on a batch of 8 rows whose cache is refilled to ``context`` before each timed step."""

    def __init__(self, forward, layers: int, context: int, transposed: bool) -> None:
        self.forward, self.layers, self.context, self.transposed = forward, layers, context, transposed
        self.cache = BatchCache(layers, transposed)
        ids = torch.randint(100, 2000, (B, context))
        mask = torch.ones(B, context, dtype=torch.long)
        forward(ids, torch.arange(context).expand(B, context), mask, self.cache, None)
        self.cache.mask = mask

    def step(self, rows) -> None:
        for layer in self.cache.layers:  # the same context length every time
            layer._set(layer.kbuf, layer.vbuf, self.context)
        self.cache.mask = self.cache.mask[:, : self.context]
        mask = self.cache.extend_mask()
        self.forward(torch.randint(100, 2000, (B, 1)), torch.full((B, 1), self.context), mask, self.cache, rows)


def main(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    setup = fused_setup(cfg, [f"a{i}" for i in range(4)], batch_hint=B)
    tok, slots, fused, slot_names = setup.tokenizer, setup.slots, setup.fused, setup.adapters
    dtype = fused.dtype
    n_layers = len(fused.layers)
    one = slots.stacks.rows_for([slot_names[0]] * B, BASE)
    four = slots.stacks.rows_for([BASE, *slot_names, *slot_names[:3]], BASE)
    res: dict[str, dict[str, float]] = {"fused": {}, "reference": {}}

    with torch.inference_mode():
        fs = Stepper(fused.forward, n_layers, args.context, True)
        res["fused"]["step"] = median_ms(lambda: fs.step(None), args.steps)
        res["fused"]["lora_1"] = median_ms(lambda: fs.step(one), args.steps) - res["fused"]["step"]
        res["fused"]["lora_4"] = median_ms(lambda: fs.step(four), args.steps) - res["fused"]["step"]

        weights = [w for lay in fused.layers for w in (lay.wqkv, lay.wo, lay.wgu, lay.wdown)] + [fused.lm_head]
        inputs = [torch.randn(B, w.dense.shape[1]).to(dtype) for w in weights]
        res["fused"]["weights"] = median_ms(lambda: [w(x) for w, x in zip(weights, inputs)], args.steps)
        res["fused"]["weights_gb_per_s"] = sum(w.nbytes for w in weights) / res["fused"]["weights"] / 1e6
        lay0 = fs.cache.layers[0]
        q = torch.randn(B, 1, fused.heads, fused.head_dim).to(dtype)
        g = fused.heads // fused.kv_heads
        bias = (
            attention_bias(fs.cache.mask, 1)
            .to(dtype)
            .expand(B, fused.kv_heads, g, 1, -1)
            .reshape(B * fused.kv_heads, g, -1)
        )
        res["fused"]["attention"] = median_ms(
            lambda: [attend(q, lay0.keys, lay0.values, bias) for _ in range(n_layers)], args.steps
        )
        res["fused"]["rest"] = res["fused"]["step"] - res["fused"]["weights"] - res["fused"]["attention"]

        def reference(ids, positions, mask, cache, rows):
            slots.begin_step([BASE] * ids.shape[0] if rows is None else rows)
            try:
                slots.forward_model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            finally:
                slots.end_step()

        rs = Stepper(reference, n_layers, args.context, False)
        res["reference"]["step"] = median_ms(lambda: rs.step(None), args.steps)
        names = [slot_names[0]] * B
        res["reference"]["lora_1"] = median_ms(lambda: rs.step(names), args.steps) - res["reference"]["step"]
        mixed = [BASE, *slot_names, *slot_names[:3]]
        res["reference"]["lora_4"] = median_ms(lambda: rs.step(mixed), args.steps) - res["reference"]["step"]

        # the model's own next-token logits after 8 real prompts (a sampler's cost depends on their shape)
        text = [
            "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, "
            f"a drawer {i + 1}, and a fridge 1. Your task is to: put a clean mug in coffeemachine. > go to"
            for i in range(B)
        ]
        ids = torch.tensor([tok(t).input_ids for t in text])
        n = ids.shape[1]
        logits = fused.forward(
            ids, torch.arange(n).expand(B, n), torch.ones(B, n, dtype=torch.long), BatchCache(n_layers, True), None
        ).float()
        params = [SamplingParams(temperature=0.7, logprobs=5)] * B
        gen = torch.Generator().manual_seed(0)
        res["fused"]["sampling"] = res["reference"]["sampling"] = median_ms(
            lambda: sample_step(logits, params, [None] * B, gen), args.steps
        )
        nucleus = [SamplingParams(temperature=0.7, top_p=0.9, logprobs=5)] * B
        res["fused"]["sampling_top_p"] = res["reference"]["sampling_top_p"] = median_ms(
            lambda: sample_step(logits, nucleus, [None] * B, gen), args.steps
        )

        prompt = torch.randint(100, 2000, (1, args.context))
        pos, pmask = torch.arange(args.context)[None], torch.ones(1, args.context, dtype=torch.long)
        res["fused"]["prefill_per_token"] = (
            median_ms(lambda: fused.forward(prompt, pos, pmask, BatchCache(n_layers, True), None), 3) / args.context
        )
        res["reference"]["prefill_per_token"] = (
            median_ms(lambda: reference(prompt, pos, pmask, BatchCache(n_layers), None), 3) / args.context
        )

    print(
        f"batch {B}, context {args.context} tokens, fused dtype {str(dtype).removeprefix('torch.')}, "
        f"reference dtype {cfg.model.dtype}; ms per decode step (prefill: ms per prompt token)"
    )
    keys = [
        "step",
        "weights",
        "weights_gb_per_s",
        "attention",
        "rest",
        "lora_1",
        "lora_4",
        "sampling",
        "sampling_top_p",
        "prefill_per_token",
    ]
    print(f"{'':10s}" + "".join(f"{k:>18s}" for k in keys))
    for path, r in res.items():
        print(f"{path:10s}" + "".join(f"{r[k]:18.2f}" if k in r else f"{'-':>18s}" for k in keys))
    f, r = res["fused"]["step"], res["reference"]["step"]
    print(f"fused_step_ms={f:.1f} reference_step_ms={r:.1f} step_speedup={r / f:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=15)
    main(p.parse_args())
