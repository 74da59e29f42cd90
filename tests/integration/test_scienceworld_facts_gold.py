"""ScienceWorld's canonical facts on the real simulator: every observation of
10 gold runs (10 tasks, a seeded dev variation each) is readable, so the real next state scores
itself Delta-F1 = 1 at every transition; and the facts move with the actions (the metric can tell
a stale prediction from the real one)."""

from __future__ import annotations

import shutil

import pytest

from comap_async.envs.scienceworld_facts import next_state
from comap_async.facts import fact_changes, state_delta_f1

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs Java 17+ (.ci/install)")
TASKS = [
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "find-animal",
    "lifespan-longest-lived",
    "use-thermometer",
    "power-component",
    "chemistry-mix",
    "melt",
    "test-conductivity",
]


def test_ten_gold_runs_real_next_state_scores_one_at_every_transition():
    from comap_async.envs.scienceworld_env import ScienceWorldTextEnv
    from comap_async.envs.scienceworld_games import discover_games

    games = discover_games("dev", tasks=TASKS, per_task=1, seed=0)
    assert len(games) == 10
    env = ScienceWorldTextEnv(max_steps=200)
    transitions = changed = stale_below_one = wins = 0
    try:
        for game in games:
            r = env.reset(game)
            state = next_state(frozenset(), r.observation)
            assert state is not None and any(f.startswith("at(") for f in state), (game.name, r.observation[:300])
            previous = r.observation
            for action in env.walkthrough():
                if r.done:
                    break
                r = env.step(action)
                score = state_delta_f1(next_state, state, r.observation, r.observation)
                assert score == 1.0, (game.name, action, r.observation[:500])
                after = next_state(state, r.observation)
                if fact_changes(state, after):
                    changed += 1
                    # predicting the previous observation again is wrong whenever the action changed something
                    stale_below_one += state_delta_f1(next_state, state, previous, r.observation) < 1.0
                state, previous = after, r.observation
                transitions += 1
            wins += r.won
    finally:
        env.close()
    assert wins == 10 and transitions >= 100
    assert changed >= transitions // 2, (changed, transitions)  # gold actions mostly change the world
    assert stale_below_one >= 0.9 * changed, (stale_below_one, changed)
    print(f"transitions={transitions} changed={changed} stale_prediction_below_1={stale_below_one}")
