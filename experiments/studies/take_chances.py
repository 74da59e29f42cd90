"""Did the agent take the task's object when it could? Played ALFWorld episodes replayed state by state.

    python experiments/studies/take_chances.py OUT/eval.json [OUT2/eval.json ...] [--config configs/local.yaml]

A held-out figure for where a played game is lost before the success rate can see it: each episode
of a ``comap eval`` (its ``eval.json`` keeps the executed actions) is replayed in its game (ALFWorld
is deterministic given the actions), and at every state the admissible commands are read. A *chance*
is a state where a ``take`` of the task's object (the object type in the game's name,
``pick_and_place_simple-Pencil-None-Dresser-330`` -> ``pencil``) is admissible: the agent stands where
the object lies. Per file: the chances and how many of them the agent took, the games with a chance,
and the games where the task's object was taken at all. With it, the drafts were found to reach
the object in most games and walk past it (docs/findings.md). Last line, per file:
``take_chances=<taken>/<chances> (<share>) games_with_chance=<k>/<games> games_taken=<j>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def task_object(game_name: str) -> str:
    """The task's object type from an ALFWorld game's name (``split/type-Object-Mrecep-Recep-scene/trial``)."""
    parts = Path(game_name).parent.name.split("-")
    if len(parts) < 4:
        raise ValueError(f"not an ALFWorld game name: {game_name!r}")
    return parts[1].lower()


def is_chance(admissible, obj: str) -> list[str]:
    """The admissible commands that take an object of type ``obj`` (empty: no chance here)."""
    return [c for c in admissible if c.startswith(f"take {obj} ")]


@dataclass
class Chances:
    states: int = 0  # states where the task's object could be taken
    taken: int = 0  # ... and the agent took it
    games: int = 0  # games with at least one such state
    games_taken: int = 0  # games where the agent took the task's object at least once

    def add(self, states: int, taken: int) -> None:
        self.states += states
        self.taken += taken
        self.games += states > 0
        self.games_taken += taken > 0


def replay(game, actions: list[str], max_steps: int) -> tuple[int, int]:
    """(chances, taken) of one played episode, replayed in ``game``."""
    from comap_async.envs.alfworld_env import AlfworldEnv

    obj = task_object(game.name)
    env = AlfworldEnv(max_steps=max_steps)
    try:
        r = env.reset(game)
        states = taken = 0
        for action in actions:
            chance = is_chance(r.admissible, obj)
            states += bool(chance)
            taken += action in chance
            r = env.step(action)
            if r.done:
                break
        return states, taken
    finally:
        env.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("evals", nargs="+", type=Path, help="eval.json files of `comap eval` (ALFWorld)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    from tqdm import tqdm

    from comap_async.config import load_config
    from comap_async.errors import CommandError
    from evaluator.compare import split_games

    cfg = load_config(args.config, args.overrides)
    if cfg.env.name != "alfworld":
        raise SystemExit(f"take_chances: ALFWorld only (env.name is {cfg.env.name!r})")
    lines, by_split = [], {}
    for path in args.evals:
        try:
            played = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"take_chances: cannot read {path}: {exc}") from None
        split = played.get("split", "valid_seen")
        if split not in by_split:  # every game of the split, as `comap eval` drew them
            try:
                by_split[split] = {g.name: g for g in split_games(cfg, split, None)}
            except (ValueError, CommandError) as exc:  # no such split, no data: one line, not a traceback
                raise SystemExit(f"take_chances: {exc}") from None
        games = by_split[split]
        total = Chances()
        for ep in tqdm(played["episodes"], desc=path.parent.name, unit="game", file=sys.stderr):
            if ep["game"] not in games:
                raise SystemExit(f"take_chances: {ep['game']} is not in split {split!r} of {cfg.env.data_dir}")
            states, taken = replay(games[ep["game"]], ep["actions"], cfg.env.max_steps)
            total.add(states, taken)
            print(f"{Path(ep['game']).parent.name}: chances={states} taken={taken} won={ep['won']}")
        share = total.taken / total.states if total.states else 0.0
        lines.append(
            f"{path}: take_chances={total.taken}/{total.states} ({share:.2f}) "
            f"games_with_chance={total.games}/{len(played['episodes'])} games_taken={total.games_taken}"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
