"""ALFWorld environment latency in one worker process: median reset and step, then steps/s.

    python benchmarks/env_step.py [--data DIR] [--games 10] [--split valid_seen]

Each game is loaded once first (its PDDL translation is cached per process, like a long-running
actor that cycles through its games), then reset and played with the handcoded expert.
"""

from __future__ import annotations

import argparse
import statistics
import time

from comap_async.envs.alfworld_env import AlfworldEnv
from comap_async.envs.alfworld_games import discover_games, resolve_data_root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="ALFWorld data root (default: $ALFWORLD_DATA)")
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--games", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30, help="steps per episode")
    args = ap.parse_args()

    games = discover_games(resolve_data_root(args.data), args.split, max_games=args.games, seed=0)
    env = AlfworldEnv(max_steps=args.steps)
    t0 = time.perf_counter()
    for game in games:
        env.reset(game)
    print(f"first_load_s_per_game={(time.perf_counter() - t0) / len(games):.3f}")

    resets, steps = [], []
    t_all, n_steps = time.perf_counter(), 0
    for game in games:
        t = time.perf_counter()
        result = env.reset(game)
        resets.append(time.perf_counter() - t)
        while not result.done:
            t = time.perf_counter()
            result = env.step(result.expert_action or "look")
            steps.append(time.perf_counter() - t)
            n_steps += 1
    wall = time.perf_counter() - t_all
    print(f"reset_median_ms={1000 * statistics.median(resets):.1f}")
    print(f"step_median_ms={1000 * statistics.median(steps):.1f}")
    print(f"env_steps_per_s={n_steps / wall:.1f}")


if __name__ == "__main__":
    main()
