"""What prefilling a joining prompt in the running rows' decode-step forward saves (``MIXED_STEP_TOKENS``).

In-process, one thread, the default model's fused forward: a decode step of ``--rows`` rows with
``--context`` tokens of KV cache each, the rows spread over three adapters (co-evolution mixes the
policy, the world model and its teacher), and a prompt of ``--prompt`` new tokens after ``--context``
cached ones on the policy's adapter (a conversation's next turn). Each round times, interleaved:

* ``alone``: the prompt's forward, then the decode step's (the earlier path, and a prompt's
  still when it is longer than ``MIXED_STEP_TOKENS``);
* ``mixed``: one forward of both (:meth:`FusedLlama.forward_parts`);
* ``decode``: the decode step by itself (what the prompt's tokens add to it).

    python benchmarks/mixed_step.py [--rows 4] [--context 900] [--prompt 72] [--tokens 1] [--rounds 15]

``--tokens 3``: each row checks two proposed tokens (a verify step). Last line:
``mixed_step_saved_ms=X alone_ms=Y mixed_ms=Z decode_ms=W`` (medians).
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
from comap_async.inference.fused import Part  # noqa: E402
from comap_async.inference.kvcache import BatchCache  # noqa: E402


def main(args: argparse.Namespace) -> None:
    setup = fused_setup(load_config(args.config), ["policy", "wm", "wm_teacher"])
    slots, fused, roles = setup.slots, setup.fused, setup.adapters
    b, c, p, t, layers = args.rows, args.context, args.prompt, args.tokens, len(fused.layers)
    decode_rows = slots.stacks.rows_for([roles[i % 3] for i in range(b)], BASE)
    prompt_rows = slots.stacks.rows_for([roles[0]], BASE)

    def filled(rows: int) -> BatchCache:
        cache = BatchCache(layers, transposed=True)
        mask = torch.ones(rows, c, dtype=torch.long)
        fused.forward(torch.randint(100, 2000, (rows, c)), torch.arange(c).expand(rows, c), mask, cache, None)
        cache.mask = mask
        return cache

    with torch.inference_mode():
        batch, own = filled(b), filled(1)

        def parts() -> tuple[Part, Part]:
            for cache in (batch, own):  # back to ``context`` columns before every timed forward
                for layer in cache.layers:
                    layer._set(layer.kbuf, layer.vbuf, c)
                cache.mask = cache.mask[:, :c]
            decode = Part(
                torch.randint(100, 2000, (b, t)),
                torch.arange(c, c + t).expand(b, t),
                batch.extend_mask(t),
                batch,
                decode_rows,
            )
            prompt = Part(
                torch.randint(100, 2000, (1, p)),
                torch.arange(c, c + p).unsqueeze(0),
                torch.ones(1, c + p, dtype=torch.long),
                own,
                prompt_rows,
            )
            return decode, prompt

        def alone() -> None:
            decode, prompt = parts()
            fused.forward_parts([prompt])
            fused.forward_parts([decode])

        def mixed() -> None:
            fused.forward_parts(list(parts()))

        def decode_only() -> None:
            fused.forward_parts([parts()[0]])

        cases = {"alone": alone, "mixed": mixed, "decode": decode_only}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for fn in cases.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(1000 * (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{b} rows x {t} token(s) at {c} columns (three adapters) and a {p}-token prompt after {c} cached "
        f"(policy adapter), one thread, {args.rounds} rounds interleaved"
    )
    print(
        f"mixed_step_saved_ms={med['alone'] - med['mixed']:.1f} alone_ms={med['alone']:.1f} "
        f"mixed_ms={med['mixed']:.1f} decode_ms={med['decode']:.1f}"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--prompt", type=int, default=72)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    main(ap.parse_args())
