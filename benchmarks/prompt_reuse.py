"""Prompt tokens a co-evolution step computes under the embedded server's prefix cache, replayed offline
from a run's stored episodes: each role's prompts with only the draft's turns (``window``: the
reflection, the world model and the teacher read ``s_t``; ``env.prompt_form: draft_turns``), against
every role's turns (``turns``: the reflection continuing the draft's conversation and the world model
and its teacher as their own conversations; ``env.prompt_form: all_turns``). The reflection's turns
alone are no prompt form: their figure is the ``turns`` line's policy column with the ``window``
line's world model and teacher columns (each role's adapter has its own cache).

For each stored episode (its main transitions in order: the conversation at step t is the first
observation and the executed actions before t with what they got) the calls of a CoMap step are
rendered: the draft, the world model on the draft (and on the executed action when it differs), the
reflection, the teacher. Each goes through a model of the server's cache (blocks of
``PREFIX_CACHE_BLOCK`` tokens (``--block``) chained per adapter, a prompt reusing the full blocks
it shares with any earlier prompt of its adapter, at least one token computed; no eviction:
``inference.prefix_cache_mb`` large enough for the episodes in flight), and the tokens it computes are
counted by role. No model runs: the outputs are the stored ones, so a form whose outputs would differ
(a reflection trained in it) is counted with today's.

    python benchmarks/prompt_reuse.py RUN_DIR [--config configs/local.yaml] [--phase coevolve] [--episodes 40]
        [--block 8]

One line per form (computed prompt tokens per env step: all, and policy / world model / teacher), then
``prompt_tokens_computed_per_step window=X turns=Y ratio=Z`` (today's form over every role as a conversation).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from comap_async.prompts import Conversation  # noqa: E402
from comap_async.wire.messages import COEVOLVE  # noqa: E402
from experiments.prefix_model import BlockCache  # noqa: E402
from experiments.system import run_records  # noqa: E402

FORMS = {
    "window": "draft_turns",
    "turns": "all_turns",
}
"""Each counted form: its ``env.prompt_form``."""
ROLES = ("policy", "wm", "teacher")


def episodes(records: list[dict]) -> list[list[dict]]:
    by_episode: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if not r.get("explore") and not r.get("recovery"):
            by_episode[r["episode"]].append(r)
    return [sorted(steps, key=lambda r: r["t"]) for steps in by_episode.values()]


def step_calls(prompts, r: dict, seen: Conversation) -> list[tuple[str, str]]:
    """A CoMap step's calls (role, prompt), in the order the actor makes them."""
    calls = [
        ("policy", prompts.draft(seen)),
        ("wm", prompts.world_model(r["s"], r["a_draft"], seen)),
        ("policy", prompts.reflect(r["s"], r["a_draft"], r["s_hat"], r.get("draft_confidence"), seen)),
    ]
    if r["a_exec"] != r["a_draft"]:
        calls.append(("wm", prompts.world_model(r["s"], r["a_exec"], seen)))
    calls.append(("teacher", prompts.teacher(r["s"], r["a_exec"], r["s_next"], seen)))
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--config", default="configs/local.yaml", help="the run's config")
    ap.add_argument("--phase", default=COEVOLVE, help="the transitions' phase (warmup: the expert's steps)")
    ap.add_argument("--episodes", type=int, default=40, help="the run's last N episodes of the phase")
    ap.add_argument("--block", type=int, help="prefix-cache block size (default: the server's, PREFIX_CACHE_BLOCK)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from comap_async.config import load_config
    from comap_async.inference.prefix import PREFIX_CACHE_BLOCK
    from comap_async.models import resolve_model
    from comap_async.prompts.template import Prompts

    records = run_records(args.run_dir, "transitions", "prompt_reuse")
    played = [e for e in episodes([r for r in records if r.get("phase") == args.phase]) if e[0]["t"] == 0]
    played = played[-args.episodes :]
    if not played:
        raise SystemExit(f"prompt_reuse: {args.run_dir} stored no whole {args.phase} episode")
    base = load_config(args.config)
    tok = Tokenizer.from_file(
        str(Path(resolve_model(base.model.name_or_path, base.model.cache_dir)) / "tokenizer.json")
    )
    steps = sum(len(e) for e in played)
    per_step = {}
    for form, prompt_form in FORMS.items():
        cfg = load_config(args.config, [f"env.prompt_form={prompt_form}"])
        prompts = Prompts.for_model(resolve_model(cfg.model.name_or_path, cfg.model.cache_dir), cfg)
        cache, computed, sent = BlockCache(args.block or PREFIX_CACHE_BLOCK), dict.fromkeys(ROLES, 0), 0
        for episode in played:
            seen = Conversation(episode[0]["goal"], episode[0]["o"])
            for r in episode:
                for role, prompt in step_calls(prompts, r, seen):
                    ids = tok.encode(prompt, add_special_tokens=True).ids
                    computed[role] += cache.computed(role, ids)
                    sent += len(ids)
                seen = seen.then(r["a_exec"], r["s_next"])
        per_step[form] = sum(computed.values()) / steps
        roles = ", ".join(f"{role} {n / steps:.0f}" for role, n in computed.items())
        print(
            f"{form}: {per_step[form]:.0f} prompt tokens computed per env step ({roles}) of {sent / steps:.0f} "
            f"sent; {len(played)} episodes, {steps} steps",
            flush=True,
        )
    w, t = per_step["window"], per_step["turns"]
    print(f"prompt_tokens_computed_per_step window={w:.0f} turns={t:.0f} ratio={w / t:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
