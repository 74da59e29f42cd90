"""How many decode steps prompt-lookup speculation (``inference.speculative_tokens``) would save, per role,
replayed offline over what a run's roles generated in co-evolution.

For each stored co-evolution transition the role's prompt is rendered as the actors rendered it and its
stored output tokenized (the teacher's ``s_hat_teacher``, the world model's ``s_hat_exec``, the
reflection's decision and final action); then the engine's proposer (:class:`NgramIndex`, with its
proposal budget) runs along the output as a greedy verify step would: a proposed token counts as
confirmed when it is the output's next token. No model runs, so the figures are those of a greedy
decode that produced these outputs (the world model samples: its figure is an upper bound).

    python benchmarks/speculative_acceptance.py RUN_DIR [--config configs/local.yaml] [--k 8] [--last 300]

Per role: output tokens, decode steps (the first token comes with the prefill and counts as one),
tokens confirmed, tokens proposed and not confirmed (each costs a token of compute in its verify step).
Last line: ``decode_steps_per_token=X`` over all roles (1.0 without speculation).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.store import ReplayStore  # noqa: E402
from comap_async.inference.speculative import NGRAM_SIZES, NgramIndex  # noqa: E402
from comap_async.prompts.messages import reflection_target  # noqa: E402
from comap_async.wire.messages import COEVOLVE, STORES  # noqa: E402


def replay(prompt_ids: list[int], out_ids: list[int], k: int, sizes: tuple[int, ...]) -> tuple[int, int, int]:
    """(decode steps, confirmed, proposed and not confirmed) for one output, as the engine would run it."""
    index = NgramIndex(prompt_ids + out_ids[:1], sizes)
    n, steps, confirmed, wasted, budget = 1, 1, 0, 0, k
    while n < len(out_ids):
        proposal = index.propose(min(budget, len(out_ids) - n - 1))
        c = 0
        while c < len(proposal) and proposal[c] == out_ids[n + c]:
            c += 1
        if proposal:
            budget = max(1, min(k, 2 * c))
        for token in out_ids[n : n + c + 1]:
            index.append(token)
        n, steps, confirmed, wasted = n + c + 1, steps + 1, confirmed + c, wasted + len(proposal) - c
    return steps, confirmed, wasted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--config", default="configs/local.yaml", help="the run's config (its prompts' wording)")
    ap.add_argument("--k", type=int, default=8, help="inference.speculative_tokens")
    ap.add_argument("--last", type=int, default=300, help="the run's last N co-evolution transitions")
    ap.add_argument("--sizes", default=",".join(map(str, NGRAM_SIZES)), help="suffix lengths looked up")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from comap_async.config import load_config
    from comap_async.models import resolve_model
    from comap_async.prompts.template import Prompts

    replay_dir = args.run_dir / "replay"
    if not (replay_dir / "data.mdb").is_file():
        raise SystemExit(f"no replay at {replay_dir}")
    cfg = load_config(args.config)
    path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    prompts, tok = Prompts.for_model(path, cfg), AutoTokenizer.from_pretrained(path)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    store = ReplayStore(replay_dir, dict.fromkeys(STORES, 1 << 40), readonly=True)
    records = [msgpack.unpackb(b, raw=False) for b in itertools.islice(store.iter_store("transitions"), None)]
    records = [r for r in records if r.get("phase") == COEVOLVE][-args.last :]
    if not records:
        raise SystemExit(f"{args.run_dir}: no co-evolution transitions stored")
    roles = {
        "reflection": lambda r: (
            prompts.reflect(r["s"], r["a_draft"], r["s_hat"], r.get("draft_confidence")),
            reflection_target(r["decision"], r["a_ref"]) if r.get("a_ref") else "",
        ),
        "world model": lambda r: (prompts.world_model(r["s"], r["a_exec"]), r.get("s_hat_exec", "")),
        "teacher": lambda r: (prompts.teacher(r["s"], r["a_exec"], r["s_next"]), r.get("s_hat_teacher", "")),
    }
    total_tokens = total_steps = 0
    for role, render in roles.items():
        tokens = steps = confirmed = wasted = 0
        for r in records:
            prompt, out = render(r)
            if not out.strip():
                continue
            out_ids = tok(out, add_special_tokens=False).input_ids + [tok.eos_token_id]
            s, c, w = replay(tok(prompt).input_ids, out_ids, args.k, sizes)
            tokens, steps, confirmed, wasted = tokens + len(out_ids), steps + s, confirmed + c, wasted + w
        total_tokens, total_steps = total_tokens + tokens, total_steps + steps
        print(
            f"{role}: {tokens} tokens in {steps} decode steps ({steps / max(1, tokens):.2f} a token), "
            f"{confirmed} confirmed, {wasted} proposed and not"
        )
    print(f"transitions={len(records)} k={args.k} sizes={args.sizes}")
    print(f"decode_steps_per_token={total_steps / max(1, total_tokens):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
