"""ScienceWorld behind the TextEnv protocol: the real simulator (a JVM from
the scienceworld wheel), its split discovery, gold sequences as the expert, restore by replay, the
step limit, and `comap env check --env scienceworld`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from comap_async.config import ConfigError, load_config
from comap_async.envs import get_next_state
from comap_async.envs.pool import AsyncEnvPool

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    shutil.which("java") is None, reason="ScienceWorld needs Java 17 on PATH (bash .ci/install installs it)"
)
SHORT = ["lifespan-longest-lived", "find-plant"]  # gold sequences of a few to a dozen steps


@pytest.fixture(scope="module")
def dev_games():
    from comap_async.envs.scienceworld_games import discover_games

    return discover_games("dev", per_task=1, seed=0)


@pytest.fixture(scope="module")
def short_games(dev_games):
    return [g for g in dev_games if g.path.split(":")[0] in SHORT]


def test_discovery_one_seeded_variation_per_task(dev_games):
    from comap_async.envs.scienceworld_games import discover_games, task_variations

    table = task_variations()
    assert len(table) == 30 and len(dev_games) == 30 and len({g.task_type for g in dev_games}) == 30
    for g in dev_games:
        task, var = g.path.rsplit(":", 1)
        assert int(var) in table[task]["dev"] and g.name == f"dev/{task}/var{var}" and g.split == "dev"
    assert [g.name for g in discover_games("dev", per_task=1, seed=0)] == [g.name for g in dev_games]
    other = discover_games("dev", per_task=1, seed=1)
    assert [g.name for g in other] != [g.name for g in dev_games]  # another seed, other variations
    assert len(discover_games("test", tasks=["boil"])) == len(table["boil"]["test"]) == 9
    assert not set(table["boil"]["dev"]) & set(table["boil"]["test"])


async def test_gold_sequences_win_and_restore_replays(short_games):
    async with AsyncEnvPool(workers=1, env_name="scienceworld", max_steps=60) as pool:
        env = pool.env()
        for game in short_games:
            first = await env.reset(game)
            gold = await env.walkthrough()
            assert first.info["task"].startswith("Your task is to") and first.admissible and not first.done
            assert first.expert_action == gold[0]
            result, rewards = first, []
            for action in gold:
                assert result.expert_action == action  # the expert is the gold sequence while on it
                result = await env.step(action)
                rewards.append(result.reward)
                if result.done:
                    break
            assert result.won and result.done and result.info["score"] == 100
            assert sum(rewards) == pytest.approx(1.0)  # the task's score, counted from 0 (not from reset's points)
            # restore by replay in a fresh simulator gives the same state
            other = pool.env()
            prefix = gold[: max(1, len(gold) // 2)]
            a, b = await env.restore(game, prefix), await other.restore(game, prefix)
            assert (a.observation, a.admissible) == (b.observation, b.admissible)
            await other.close()
        # off the gold path the expert has nothing to offer; the step limit ends the episode
        await env.reset(short_games[0])
        off = await env.step("look around")
        assert off.expert_action is None


async def test_a_wrong_focus_fails_the_task_and_scores_0_not_minus_100(short_games):
    """The benchmark's 0-100 scale: the simulator's -100 marks a failed task, which counts 0, and points a
    task held before the failure are lost with it (they were paid out as rewards, so they are taken back)."""
    async with AsyncEnvPool(workers=1, env_name="scienceworld", max_steps=60) as pool:
        env = pool.env()
        for game in short_games:
            first = await env.reset(game)
            gold = await env.walkthrough()
            wrong = next(a for a in first.admissible if a.startswith("focus on") and a not in gold)
            result, rewards = first, []
            for action in [*[a for a in gold[:2] if not a.startswith("focus on")], wrong]:
                result = await env.step(action)
                rewards.append(result.reward)
            assert result.done and not result.won and result.info["score"] == -100
            assert sum(rewards) == pytest.approx(0.0) and not result.info["truncated"]


async def test_step_limit_truncates(dev_games):
    game = next(g for g in dev_games if g.path.startswith("find-plant:"))
    async with AsyncEnvPool(workers=1, env_name="scienceworld", max_steps=2) as pool:
        env = pool.env()
        await env.reset(game)
        await env.step("look around")
        last = await env.step("look around")
        assert last.done and not last.won and last.info["truncated"]


def test_config_splits_per_environment_and_facts():
    assert load_config(None, ["env.name=scienceworld", "env.split=dev"]).env.split == "dev"
    with pytest.raises(ConfigError, match="not a split of scienceworld"):
        load_config(None, ["env.name=scienceworld", "env.split=valid_seen"])
    with pytest.raises(ConfigError, match="not a split of alfworld"):
        load_config(None, ["env.split=dev"])
    assert get_next_state("scienceworld").__module__ == "comap_async.envs.scienceworld_facts"
    assert load_config(None, ["env.name=scienceworld"]).eval.split == "dev"  # the env's held-out split
    with pytest.raises(ConfigError, match="eval.split='valid_seen' is not a split of scienceworld"):
        load_config(None, ["env.name=scienceworld", "eval.split=valid_seen"])


def test_env_check_replays_gold_sequences():
    cmd = [
        sys.executable,
        "-m",
        "comap_async",
        "env",
        "check",
        "--env",
        "scienceworld",
        "--split",
        "dev",
        "--per-task",
        "1",
        "--tasks",
        ",".join(SHORT),
        "--workers",
        "1",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "games=2 walkthrough_wins=2" and "step median" in lines[-2]
    bad = subprocess.run(cmd[:-4] + ["--tasks", "boiling"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown ScienceWorld task(s) boiling" in bad.stderr


def test_pool_replies_bigger_than_a_socket_buffer_under_uvloop():
    """The actors run on uvloop, which makes the pool's pipe non-blocking: a reply listing hundreds
    of valid actions used to arrive in parts and kill the worker connection (every episode failed)."""
    uvloop = pytest.importorskip("uvloop")

    async def play() -> list[int]:
        sizes = []
        async with AsyncEnvPool(workers=1, env_name="scienceworld") as pool:
            env = pool.env()
            for game in ("chemistry-mix-paint-secondary-color:11", "chemistry-mix:10"):
                sizes.append(len((await env.reset(game)).admissible))
                for action in (await env.walkthrough())[:3]:
                    sizes.append(len((await env.step(action)).admissible))
        return sizes

    sizes = uvloop.run(play())
    assert max(sizes) > 500, sizes  # a kitchen: ~1,000 valid actions in one reply


def test_a_replay_that_ends_early_is_a_typed_error_across_the_pool():
    """Restoring a prefix that wins before its end (a gold sequence's trailing steps, or a replay the
    simulator does not repeat) cannot rebuild the state: RestoreDiverged, in process and from a worker."""
    from comap_async.envs.base import RestoreDiverged
    from comap_async.envs.scienceworld_env import ScienceWorldTextEnv

    game = "lifespan-longest-lived:62"
    env = ScienceWorldTextEnv(max_steps=20)
    try:
        env.reset(game)
        gold = env.walkthrough()
        with pytest.raises(RestoreDiverged, match="episode ended after"):
            env.restore(game, [*gold, "look around"])
        assert env.restore(game, gold[:1]).done is False  # still usable
    finally:
        env.close()

    async def through_pool() -> None:
        async with AsyncEnvPool(workers=1, env_name="scienceworld") as pool:
            penv = pool.env()
            with pytest.raises(RestoreDiverged):
                await penv.restore(game, [*gold, "look around"])
            assert (await penv.reset(game)).done is False

    import asyncio

    asyncio.run(through_pool())


def test_the_state_shows_the_room_the_agent_is_in_with_show_location():
    """``env.show_location``: the simulator's free look after every step is the state's ``Where you
    are:`` block, so a policy without an admissible list still knows the room after moving."""
    from types import SimpleNamespace

    from actors.episodes import Episode, EpisodeContext
    from comap_async.envs.scienceworld_env import ScienceWorldTextEnv

    env = ScienceWorldTextEnv(max_steps=40)
    try:
        first = env.reset("find-animal:177")  # starts in the hallway, its doors open
        moved = env.step("go to kitchen")
    finally:
        env.close()
    assert first.location.startswith("This room is called the hallway.")
    assert moved.location.startswith("This room is called the kitchen.")
    cfg = load_config(REPO / "configs" / "scienceworld-local.yaml")
    assert cfg.env.show_location  # the CPU default shows it
    states = {}
    for shown in (True, False):
        run_cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"show_location": shown})})
        ctx = EpisodeContext(
            actor="t", cfg=run_cfg, llm=None, emit=None, next_state=lambda facts, o: facts, registry=lambda: None
        )
        ep = Episode(ctx, SimpleNamespace(name="dev/find-animal/var177", split="dev"), "e", first)
        ep.advance("go to kitchen", moved)
        states[shown] = ep.state()
        assert ep.location_at(0) == (first.location if shown else "")
    assert "Where you are: This room is called the kitchen." in states[True]
    assert "Where you are" not in states[False]
