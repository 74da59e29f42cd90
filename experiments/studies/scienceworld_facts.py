"""How much of what ScienceWorld really says its fact parser can read (the simulator, no model).

Plays ``--games`` seeded variations (one split, every task in turn): the gold sequence, and after a
few gold steps a random walk of valid actions (``focus on`` left out: it ends the episode), as an
untrained policy would wander. Every real observation goes through
``comap_async.envs.scienceworld_facts.next_state``; the unreadable ones are counted (their
transitions get no Delta-F1) and the most frequent are printed, so a new sentence form shows up.

    python experiments/studies/scienceworld_facts.py [--games 30] [--random-steps 30] [--split train]

Last line: ``scienceworld_facts_readable=X`` (the readable share of all real observations).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", type=int, default=30)
    ap.add_argument("--random-steps", type=int, default=30)
    ap.add_argument("--split", default="train", choices=("train", "dev", "test"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from comap_async.envs.scienceworld_env import ScienceWorldTextEnv
    from comap_async.envs.scienceworld_facts import next_state
    from comap_async.envs.scienceworld_games import discover_games

    games = discover_games(args.split, per_task=1, seed=args.seed)[: args.games]
    rng = random.Random(args.seed)
    env = ScienceWorldTextEnv(max_steps=10_000)
    counts = {"gold": [0, 0], "random": [0, 0]}  # [observations, unreadable]
    unreadable: collections.Counter[str] = collections.Counter()
    t0 = time.perf_counter()
    try:
        for game in games:
            for kind in ("gold", "random"):
                r = env.reset(game)
                state = next_state(frozenset(), r.observation)
                observations = [r.observation]
                gold = env.walkthrough()
                plan = gold if kind == "gold" else gold[: rng.randint(0, min(5, len(gold)))]
                for action in plan:
                    if r.done:
                        break
                    r = env.step(action)
                    observations.append(r.observation)
                for _ in range(args.random_steps if kind == "random" else 0):
                    if r.done:
                        break
                    valid = [a for a in r.admissible if not a.startswith("focus on")]
                    r = env.step(rng.choice(valid) if valid else "look around")
                    observations.append(r.observation)
                for text in observations:
                    counts[kind][0] += 1
                    after = next_state(state if state is not None else frozenset(), text)
                    if after is None:
                        counts[kind][1] += 1
                        unreadable[text[:160]] += 1
                    else:
                        state = after
    finally:
        env.close()
    for text, n in unreadable.most_common(10):
        print(f"unreadable x{n}: {text!r}")
    for kind, (n, bad) in counts.items():
        print(f"{kind}: observations={n} unreadable={bad}")
    total, bad = sum(n for n, _ in counts.values()), sum(b for _, b in counts.values())
    print(f"games={len(games)} wall_s={time.perf_counter() - t0:.1f}")
    print(f"scienceworld_facts_readable={(total - bad) / max(1, total):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
