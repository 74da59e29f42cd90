"""What a row joining or leaving the embedded server's running batch costs, in place (``BatchCache``; copying
the whole batch each time, the earlier path, went with ``inference.kv_in_place``: docs/benchmarks.md), on the
KV geometry of the default model, one thread.

A seeded trace like co-evolution's in the turns forms: up to ``--rows`` rows whose prompts are
conversations of ``--min-tokens``-``--max-tokens`` tokens; each event is a row joining (its prefilled
KV merged into the batch), a row leaving, or a few decode steps (every row gains a column). The cache
replays the trace ``--rounds`` times; the decode steps' column writes are timed apart.

    python benchmarks/kv_join_leave.py [--rounds 3] [--events 400]

Last line: ``kv_join_leave_ms in_place=Y`` (median milliseconds per join or leave).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comap_async.inference.kvcache import BatchCache  # noqa: E402

SMOLLM2_135M = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}


def geometry(model_dir: Path | None) -> dict[str, int]:
    """Layers, KV heads and head size of a prepared model (SmolLM2-135M's without one)."""
    if model_dir is None:
        return SMOLLM2_135M
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir).get_text_config()
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {"num_hidden_layers": c.num_hidden_layers, "num_key_value_heads": c.num_key_value_heads, "head_dim": head}


def trace(seed: int, events: int, rows: int, lo: int, hi: int) -> list[tuple[str, int]]:
    rng, running, out = random.Random(seed), 0, []
    for _ in range(events):
        r = rng.random()
        if running < rows and (r < 0.35 or running < rows // 2):
            out.append(("join", rng.randint(lo, hi)))
            running += 1
        elif r < 0.7 and running > 1:
            out.append(("leave", rng.randrange(running)))
            running -= 1
        else:
            out.append(("decode", rng.randint(1, 6)))
    return out


def prefilled(kind: type, geo: dict[str, int], n: int, dtype: torch.dtype) -> BatchCache:
    c = kind(geo["num_hidden_layers"], transposed=True)
    h, d = geo["num_key_value_heads"], geo["head_dim"]
    for layer in c.layers:
        layer.update(torch.randn(1, h, n, d, dtype=dtype), torch.randn(1, h, n, d, dtype=dtype))
    c.mask = torch.ones(1, n, dtype=torch.long)
    return c


def replay(kind: type, geo: dict[str, int], events: list[tuple[str, int]], rows: int, dtype: torch.dtype) -> dict:
    cache = kind(geo["num_hidden_layers"], transposed=True, rows_hint=rows)
    h, d = geo["num_key_value_heads"], geo["head_dim"]
    joins_leaves, decode = [], 0.0
    for op, arg in events:
        if op == "join":
            joiner = prefilled(kind, geo, arg, dtype)  # prefill's own cost: not timed
            t0 = time.perf_counter()
            cache.merge(joiner)
            joins_leaves.append(time.perf_counter() - t0)
        elif op == "leave":
            t0 = time.perf_counter()
            cache.select([i for i in range(cache.batch) if i != arg])
            joins_leaves.append(time.perf_counter() - t0)
        else:
            b = cache.batch
            t0 = time.perf_counter()
            for _ in range(arg):
                cache.extend_mask()
                for layer in cache.layers:
                    layer.update(torch.zeros(b, h, 1, d, dtype=dtype), torch.zeros(b, h, 1, d, dtype=dtype))
            decode += time.perf_counter() - t0
    return {
        "ms": 1000 * statistics.median(joins_leaves),
        "mean_ms": 1000 * statistics.fmean(joins_leaves),
        "decode_s": decode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--rows", type=int, default=8, help="inference.max_batch_size")
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=1600, help="a turns-form conversation by step ~40")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a prepared model (its config.json); default SmolLM2-135M's geometry",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    geo = geometry(args.model_dir)
    dtype = torch.bfloat16
    events = trace(0, args.events, args.rows, args.min_tokens, args.max_tokens)
    kinds = {"in_place": BatchCache}
    ms: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for name in list(kinds)[:: 1 if r % 2 == 0 else -1]:
            res = replay(kinds[name], geo, events, args.rows, dtype)
            ms[name].append(res["ms"])
            print(
                f"round={r} {name}: {res['ms']:.1f} ms median, {res['mean_ms']:.1f} mean per join or leave; "
                f"decode column writes {res['decode_s']:.2f} s",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"kv_join_leave_ms in_place={med['in_place']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
