"""``comap env check --split NAME --data DIR``: load a split, replay walkthroughs, run the expert."""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    chk = sub.add_parser("check", help="count games, walkthrough wins and handcoded-expert wins of a split")
    chk.add_argument(
        "--env",
        default="alfworld",
        choices=["alfworld", "scienceworld"],
        help="which environment (scienceworld: its games ship in the package, no --data)",
    )
    chk.add_argument(
        "--split",
        default=None,
        help="alfworld: train, valid_seen (default), valid_unseen, valid_train; scienceworld: train, dev "
        "(default), test",
    )
    chk.add_argument(
        "--per-task",
        type=int,
        default=None,
        metavar="N",
        help="scienceworld: N variations of each task, drawn with --seed (a split holds thousands)",
    )
    chk.add_argument("--tasks", default=None, help="scienceworld: comma-separated task names (default: all 30)")
    chk.add_argument("--data", default=None, metavar="DIR", help="ALFWorld data root (default: $ALFWORLD_DATA)")
    chk.add_argument("--games", type=int, default=None, metavar="N", help="check only N games (sampled with --seed)")
    chk.add_argument("--seed", type=int, default=0)
    chk.add_argument("--max-steps", type=int, default=50, help="step limit of the expert's own episodes")
    chk.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    chk.add_argument(
        "--fact-baselines",
        action="store_true",
        help="instead of the check: mean Delta-F1 of three fixed predictors over every walkthrough "
        "transition (copy the previous observation, arrive at a random other receptacle, the real "
        "next observation), at the state level and at the old observation level",
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.env == "scienceworld":
        return _check_scienceworld(args)
    from comap_async.envs.registry import ENVS

    splits = ENVS["alfworld"].splits
    args.split = args.split or ENVS["alfworld"].held_out_split
    if args.split not in splits:
        print(f"comap env: error: {args.split!r} is not an ALFWorld split ({', '.join(splits)})", file=sys.stderr)
        return 2

    from comap_async.envs.alfworld_check import check_games
    from comap_async.envs.alfworld_games import AlfworldDataError, discover_games, resolve_data_root

    try:
        games = discover_games(resolve_data_root(args.data), args.split, max_games=args.games, seed=args.seed)
    except AlfworldDataError as exc:
        print(f"comap env: error: {exc}", file=sys.stderr)
        return 2
    if args.fact_baselines:
        return _print_baselines(games, args)
    checks = []
    for check in tqdm(
        check_games(games, args.max_steps, args.workers), total=len(games), desc=args.split, file=sys.stderr
    ):
        checks.append(check)
    observations = sum(c.observations for c in checks)
    unparseable = [o for c in checks for o in c.unparseable]
    walk_wins = sum(c.walkthrough_won for c in checks)
    expert_wins = sum(c.expert_won for c in checks)
    missing = sum(c.expert_missing_steps for c in checks)
    from_walk = sum(c.expert_from_walkthrough for c in checks)
    walk_steps = sum(c.observations for c in checks)
    print(f"split={args.split} games={len(games)}")
    print(
        f"walkthrough: {walk_wins}/{len(checks)} won; expert action present at {walk_steps - missing}/{walk_steps} "
        f"steps ({from_walk} from the walkthrough after the handcoded expert failed)"
    )
    print(f"handcoded expert within {args.max_steps} steps: {expert_wins}/{len(checks)} won")
    print(
        f"facts: {len(unparseable)}/{observations} observations unparseable "
        f"({100 * len(unparseable) / max(observations, 1):.2f}%), "
        f"{sum(c.self_f1_below_one for c in checks)} transitions with self Delta-F1 < 1"
    )
    for text in unparseable[:5]:
        print(f"  unparseable: {text[:160]!r}")
    print(f"games={len(games)} walkthrough_wins={walk_wins} expert_wins={expert_wins}")
    return 0


def _print_baselines(games: list, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from comap_async.envs.alfworld_check import BASELINES, baselines_of_games

    state = {b: [] for b in BASELINES}
    observation = {b: [] for b in BASELINES}
    for res in tqdm(
        baselines_of_games(games, args.max_steps, args.workers, args.seed),
        total=len(games),
        desc=f"{args.split} fact baselines",
        file=sys.stderr,
    ):
        for b in BASELINES:
            state[b] += res.state[b]
            observation[b] += res.observation[b]

    def line(scores: dict[str, list[float]]) -> str:
        return " ".join(f"{b}={sum(v) / len(v):.3f}" if v else f"{b}=n/a" for b, v in scores.items())

    print(f"split={args.split} games={len(games)} transitions={len(state['real_next'])}")
    print(f"observation_level {line(observation)}")
    print(line(state))
    return 0


def _check_scienceworld(args: argparse.Namespace) -> int:
    """Gold-sequence replay of ScienceWorld variations; last line ``games=N walkthrough_wins=M``."""
    import statistics
    import time

    from tqdm import tqdm

    from comap_async.envs.scienceworld_check import check_games
    from comap_async.envs.scienceworld_games import ScienceWorldError, discover_games

    split = args.split or "dev"
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    t0 = time.perf_counter()
    try:
        games = discover_games(split, tasks=tasks, per_task=args.per_task, max_games=args.games, seed=args.seed)
    except ScienceWorldError as exc:
        print(f"comap env: error: {exc}", file=sys.stderr)
        return 2
    checks = []
    for check in tqdm(
        check_games(games, args.workers), total=len(games), desc=f"scienceworld {split}", file=sys.stderr
    ):
        checks.append(check)
    wall = time.perf_counter() - t0
    wins = sum(c.won for c in checks)
    steps = [s for c in checks for s in c.step_s]
    resets = [c.reset_s for c in checks if not c.error]
    for c in sorted(checks, key=lambda c: c.name):
        if not c.won:
            print(f"  not won: {c.name} score={c.score} gold_steps={c.gold_steps} {c.error or ''}".rstrip())
    print(f"split={split} games={len(games)} gold steps={len(steps)} wall={wall:.1f}s workers={args.workers}")
    if steps and resets:
        print(
            f"latency: reset (load + gold path) median {1000 * statistics.median(resets):.0f} ms, step median "
            f"{1000 * statistics.median(steps):.1f} ms (p90 {1000 * sorted(steps)[int(0.9 * len(steps))]:.1f} ms)"
        )
    print(f"games={len(games)} walkthrough_wins={wins}")
    return 0 if wins == len(games) else 1
