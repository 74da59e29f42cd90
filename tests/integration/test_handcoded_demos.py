"""``actor.demonstrations: handcoded`` on real games: warm-up demonstrates the handcoded expert's own
winning play (its search of the receptacles), replayed exactly from the reset; where the expert does
not win, the walkthrough."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.episodes import EpisodeContext
from actors.expert_play import demonstration_start, play_expert
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.envs.pool import AsyncEnvPool
from comap_async.wire.messages import Registry
from comap_async.wire.protocol import as_map, validate

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def context(alfworld_data: Path, *overrides: str) -> tuple[EpisodeContext, list[dict]]:
    cfg = load_config(
        REPO / "configs" / "test.yaml",
        [f"env.data_dir={alfworld_data}", "env.max_steps=50", "actor.demonstrations=handcoded", *overrides],
    )
    sent: list[dict] = []

    async def emit(msg):
        sent.append(as_map(validate(msg)))

    return EpisodeContext("a", cfg, None, emit, next_state, Registry), sent


async def test_the_plan_is_the_experts_own_winning_play_replayed_from_the_reset(alfworld_data, train_games):
    ctx, _ = context(alfworld_data)
    games = train_games[:4]
    searched = 0
    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        env = pool.env()
        for game in games:
            first, plan, fallback = await demonstration_start(ctx, env, game)
            walkthrough = await env.walkthrough()
            fresh = await pool.env().reset(game)
            assert first.observation == fresh.observation and first.expert_action == fresh.expert_action
            if fallback:
                assert plan == walkthrough
                continue
            # env was left at the reset: the plan replays there, each action the expert's own label, and wins
            result = first
            for action in plan:
                assert result.expert_action == action and not result.done
                result = await env.step(action)
            assert result.won
            searched += plan != walkthrough
    assert searched, "the handcoded expert took the walkthrough's path in every game: nothing searched"


async def test_a_game_the_expert_does_not_win_demonstrates_the_walkthrough(alfworld_data, train_games):
    ctx, _ = context(alfworld_data)
    game = train_games[0]
    # two steps are too few for any path: the expert's play is cut short unwon
    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=2) as pool:
        env = pool.env()
        first, plan, fallback = await demonstration_start(ctx, env, game)
        assert fallback and plan == await env.walkthrough()
        assert first.observation == (await pool.env().reset(game)).observation


async def test_warmup_sends_the_experts_search_as_the_demonstrated_path(alfworld_data, train_games):
    ctx, sent = context(alfworld_data, "actor.warmup_explore=0", "env.prompt_form=draft_turns")
    game = train_games[1]
    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        _, plan, fallback = await demonstration_start(ctx, pool.env(), game)
        stats = await play_expert(ctx, pool.env(), game, "a:e1", branch=pool.env())
    assert stats.won and stats.demo_fallback == fallback
    (path,) = [m for m in sent if m["type"] == "turn_demos"]
    assert [a for a, _ in path["turns"]] == plan and all(path["targets"])
