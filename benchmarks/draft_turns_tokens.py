"""What a demonstrated action costs the learner in each draft prompt form (``env.prompt_form`` window,
draft_turns), on real held-out walkthroughs: no model runs, only the environment and the model's tokenizer.

    python benchmarks/draft_turns_tokens.py [--split valid_seen] [--games 10] [--config configs/local.yaml]

Per game (every ``len(split) // games``-th, sorted by name) the walkthrough is played; each step's
per-step sample (its ``s_t`` draft prompt, ``env.history_k`` and the admissible list as configured, then
the action) is tokenised as the learner does, and the whole path as one ``turn_demos`` sequence
(``learner/batches.py``, ``Encoder.path``, with no length cap). It also checks, step by step, that the
path holds each action exactly after the prompt an actor sends at that step. Last line:
``tokens_per_action window=W turns=T ratio=R`` over all the games' actions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"))
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--games", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from comap_async.config import load_config
    from comap_async.envs import games_from_config
    from comap_async.envs.alfworld_env import AlfworldEnv
    from comap_async.models import resolve_model
    from comap_async.prompts import ChatTemplate, Conversation, Prompts, render_state
    from learner.batches import Encoder

    cfg = load_config(args.config, args.overrides)
    path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    enc = Encoder(AutoTokenizer.from_pretrained(path), Prompts(ChatTemplate.from_model_dir(path)), 1 << 20, 1 << 20)
    games = sorted(games_from_config(cfg, args.split), key=lambda g: g.name)
    games = games[:: max(1, len(games) // args.games)][: args.games]
    env, e = AlfworldEnv(max_steps=cfg.env.max_steps), cfg.env
    window_total = turns_total = actions = 0
    for game in games:
        r = env.reset(game)
        first, history, window = r.observation, [], 0
        for action in env.walkthrough():
            if r.done:
                break
            state = render_state(env.task, history, r.observation, r.admissible, e.history_k, e.show_admissible)
            window += len(enc.seq(enc.prompts.draft(state), action).ids)
            r = env.step(action)
            history.append((action, r.observation))
        seq = enc.draft({"goal": env.task, "first": first, "turns": history, "targets": [True] * len(history)})
        for i, (action, _) in enumerate(history):
            prompt = enc._ids(enc.prompts.draft(Conversation(env.task, first, tuple(history[:i]))))
            target = enc._ids(action + enc.eos)
            if seq.ids[: len(prompt) + len(target)] != prompt + target:
                raise SystemExit(f"{game.name}: step {i}'s action is not where its prompt ends")
        print(f"{game.name} actions={len(history)} won={r.won} window_tokens={window} path_tokens={len(seq.ids)}")
        window_total, turns_total, actions = window_total + window, turns_total + len(seq.ids), actions + len(history)
    env.close()
    w, t = window_total / actions, turns_total / actions
    print(f"tokens_per_action window={w:.1f} turns={t:.1f} ratio={w / t:.2f}")


if __name__ == "__main__":
    main()
