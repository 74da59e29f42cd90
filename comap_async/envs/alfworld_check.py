"""Per-game health check: the walkthrough wins, the expert labels every step, the facts parse.

Used by ``comap env check`` and the integration tests; :func:`check_games` spreads games over
worker processes (each installs the TextWorld caches once and keeps them across its games).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from comap_async.envs.alfworld_facts import next_state, parse_facts
from comap_async.envs.base import GameInfo
from comap_async.facts import delta_f1, state_delta_f1


@dataclass
class GameCheck:
    name: str
    walkthrough_won: bool
    walkthrough_steps: int
    expert_missing_steps: int
    """Walkthrough states before the win (reset included) that had no expert action."""
    expert_from_walkthrough: int
    """Walkthrough steps labelled by the walkthrough because the handcoded expert had failed."""
    expert_won: bool
    expert_steps: int
    observations: int
    unparseable: list[str] = field(default_factory=list)
    self_f1_below_one: int = 0
    """Real transitions where Delta-F1 of the real observation against itself was not 1.0."""


_ENV = None


def _env(max_steps: int):  # one env per worker process, reused across its games
    global _ENV
    if _ENV is None or _ENV.max_steps != max_steps:
        from comap_async.envs.alfworld_env import AlfworldEnv

        _ENV = AlfworldEnv(max_steps=max_steps)
    return _ENV


def replay_walkthrough(env, game: GameInfo) -> tuple[list[str], list]:
    """(walkthrough, results of the reset and of every walkthrough step), replayed in full even
    when the walkthrough is longer than the step limit."""
    results = [env.reset(game)]
    walk = env.walkthrough()
    limit, env.max_steps = env.max_steps, max(env.max_steps, len(walk) + 1)
    try:
        results += [env.step(action) for action in walk]
    finally:
        env.max_steps = limit
    return walk, results


def check_game(game: GameInfo, max_steps: int = 50, run_expert: bool = True) -> GameCheck:
    env = _env(max_steps)
    walk, results = replay_walkthrough(env, game)
    facts = [parse_facts(r.observation) for r in results]
    unparseable = [r.observation for r, f in zip(results, facts) if f is None]
    below = sum(
        1
        for prev, real in zip(facts, facts[1:])
        if prev is not None and real is not None and delta_f1(prev, real, real) != 1.0
    )
    check = GameCheck(
        name=game.name,
        walkthrough_won=results[-1].won,
        walkthrough_steps=len(walk),
        expert_missing_steps=sum(1 for r in results if r.expert_action is None and not r.won),
        expert_from_walkthrough=sum(1 for r in results if r.info.get("expert_source") == "walkthrough"),
        expert_won=False,
        expert_steps=0,
        observations=len(results),
        unparseable=unparseable,
        self_f1_below_one=below,
    )
    if not run_expert:
        return check
    result = env.reset(game)
    while not result.done and result.expert_action is not None:
        result = env.step(result.expert_action)
    check.expert_won, check.expert_steps = result.won, env.steps
    return check


BASELINES = ("copy_previous", "random_receptacle", "real_next")
_RECEPTACLES = re.compile(r"Looking quickly around you, you see (.*?)\.\s*(?:\n|$)")
_NAME = re.compile(r"[a-z]+ \d+")


@dataclass
class FactBaselines:
    """Delta-F1 of fixed predictors over one game's walkthrough transitions, at the state level
    (what the system uses) and at the observation level (the definition it replaced)."""

    name: str
    state: dict[str, list[float]]
    observation: dict[str, list[float]]


def _baseline_predictions(
    rng: random.Random, receptacles: list[str], prev_obs: str, real: str, location: str | None
) -> dict[str, str]:
    others = [r for r in receptacles if r != location] or receptacles
    return {"copy_previous": prev_obs, "random_receptacle": f"You arrive at {rng.choice(others)}.", "real_next": real}


def fact_baselines(game: GameInfo, max_steps: int = 50, seed: int = 0) -> FactBaselines:
    """Replay the walkthrough and score three fixed predictors of each next observation: "copy the
    previous observation", "arrive at a random other receptacle" (seeded by ``seed`` and the game)
    and "the real next observation" (1.0 by construction, a check of the scorer)."""
    _, results = replay_walkthrough(_env(max_steps), game)
    observations = [r.observation for r in results]
    m = _RECEPTACLES.search(observations[0])
    receptacles = _NAME.findall(m.group(1)) if m else []
    rng = random.Random(f"{seed}:{game.name}")
    out = FactBaselines(game.name, {b: [] for b in BASELINES}, {b: [] for b in BASELINES})
    state = next_state(frozenset(), observations[0]) or frozenset()
    for prev_obs, real in zip(observations, observations[1:]):
        location = next((f[3:-1] for f in state if f.startswith("at(")), None)
        preds = _baseline_predictions(rng, receptacles, prev_obs, real, location) if receptacles else {}
        prev_f, real_f = parse_facts(prev_obs), parse_facts(real)
        for name, pred in preds.items():
            score = state_delta_f1(next_state, state, pred, real)
            if score is not None:
                out.state[name].append(score)
            if prev_f is not None and real_f is not None:
                out.observation[name].append(delta_f1(prev_f, parse_facts(pred), real_f))
        state = next_state(state, real) or state
    return out


def _map_games(fn: Callable, jobs: list[tuple], workers: int) -> Iterator:
    if workers <= 1:
        for job in jobs:
            yield fn(*job)
        return
    with mp.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(_star, [(fn, job) for job in jobs], chunksize=1)


def _star(args: tuple[Callable, tuple]) -> object:
    fn, job = args
    return fn(*job)


def baselines_of_games(
    games: Sequence[GameInfo], max_steps: int = 50, workers: int = 1, seed: int = 0
) -> Iterator[FactBaselines]:
    """:func:`fact_baselines` of each game in ``workers`` processes (any order)."""
    return _map_games(fact_baselines, [(g, max_steps, seed) for g in games], workers)


def check_games(
    games: Sequence[GameInfo], max_steps: int = 50, workers: int = 1, run_expert: bool = True
) -> Iterator[GameCheck]:
    """Check games in ``workers`` processes; yields results as they finish (any order)."""
    return _map_games(check_game, [(g, max_steps, run_expert) for g in games], workers)
