"""Environment steps per second of the ScienceWorld env pool (the simulator alone, no model).

``--envs`` environments on ``--workers`` worker processes (one JVM per environment) each replay the
gold sequences of seeded dev variations, concurrently, as actors' episodes would; reset (load +
gold path) and step latencies are printed, the steps/s last.

    python benchmarks/scienceworld_env.py [--envs 4] [--workers 2] [--steps 400]

Last line: ``scienceworld_env_steps_per_s=X``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def run(envs: int, workers: int, steps: int, seed: int) -> tuple[float, list[float], list[float]]:
    from comap_async.envs.pool import AsyncEnvPool
    from comap_async.envs.scienceworld_games import discover_games

    games = discover_games("dev", per_task=1, seed=seed)
    resets: list[float] = []
    step_s: list[float] = []
    done = 0

    async def play(env, first: int) -> None:
        nonlocal done
        i = first
        while done < steps:
            game = games[i % len(games)]
            i += envs
            t = time.perf_counter()
            await env.reset(game)
            resets.append(time.perf_counter() - t)
            for action in await env.walkthrough():
                if done >= steps:
                    return
                t = time.perf_counter()
                result = await env.step(action)
                step_s.append(time.perf_counter() - t)
                done += 1
                if result.done:
                    break

    async with AsyncEnvPool(workers=workers, env_name="scienceworld", max_steps=10_000) as pool:
        pool_envs = [pool.env() for _ in range(envs)]
        for env in pool_envs:  # start every simulator before the clock runs (JVM start ~1.4 s each)
            await env.reset(games[0])
        resets.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(play(env, k) for k, env in enumerate(pool_envs)))
        wall = time.perf_counter() - t0
    return done / wall, resets, step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400, help="gold steps to take in all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rate, resets, steps = asyncio.run(run(args.envs, args.workers, args.steps, args.seed))
    print(f"envs={args.envs} workers={args.workers} steps={len(steps)} resets={len(resets)}")
    print(
        f"reset (load + gold path) median {1000 * statistics.median(resets):.0f} ms; "
        f"step median {1000 * statistics.median(steps):.1f} ms, "
        f"p90 {1000 * sorted(steps)[int(0.9 * len(steps))]:.1f} ms"
    )
    print(f"scienceworld_env_steps_per_s={rate:.1f}")


if __name__ == "__main__":
    main()
