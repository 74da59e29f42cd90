"""ALFWorld on real games: walkthroughs, facts, restore by replay, speed-up identity, async pool."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time

import pytest

from comap_async.envs.alfworld_check import check_games
from comap_async.envs.alfworld_env import AlfworldEnv
from comap_async.envs.pool import AsyncEnvPool, EnvWorkerError

pytestmark = pytest.mark.alfworld


@pytest.mark.slow
def test_valid_seen_walkthroughs_win_with_expert_labels_and_readable_facts(valid_seen):
    assert len(valid_seen) == 140
    checks = list(check_games(valid_seen, workers=2, run_expert=False))
    assert sum(c.walkthrough_won for c in checks) == 140
    assert sum(c.expert_missing_steps for c in checks) == 0
    observations = sum(c.observations for c in checks)
    unparseable = sum(len(c.unparseable) for c in checks)
    print(f"unparseable observations: {unparseable}/{observations} = {100 * unparseable / observations:.2f}%")
    assert unparseable / observations < 0.01
    assert sum(c.self_f1_below_one for c in checks) == 0


def _play(game, actions, speedups):
    env = AlfworldEnv(speedups=speedups)
    results = [env.reset(game)]
    results += [env.step(a) for a in actions]
    return [(r.observation, r.admissible, r.won, r.expert_action) for r in results]


def _random_actions(env, game, n, rng):
    result, actions = env.reset(game), []
    while len(actions) < n and not result.done:
        action = rng.choice(result.admissible)
        actions.append(action)
        result = env.step(action)
    return actions


def test_speedups_give_identical_output(valid_seen):
    rng = random.Random(1)
    games = rng.sample(valid_seen, 3)
    env = AlfworldEnv()
    plans = [_random_actions(env, g, 8, rng) for g in games]
    fast = [_play(g, p, True) for g, p in zip(games, plans)]
    # stock TextWorld must run in a process where the caches were never installed
    with mp.get_context("spawn").Pool(1) as pool:
        stock = pool.starmap(_play, [(g, p, False) for g, p in zip(games, plans)])
    assert fast == stock


def test_restore_by_replay_reproduces_state(valid_seen):
    rng = random.Random(7)
    original, restored = AlfworldEnv(), AlfworldEnv()
    for game in rng.sample(valid_seen, 6):
        original.reset(game)
        walk = original.walkthrough()
        # a prefix that mixes walkthrough moves and random ones, as a suffix rollout would start from
        actions = walk[: rng.randint(0, len(walk) - 1)]
        result = original.reset(game)
        for a in actions:
            result = original.step(a)
        for _ in range(rng.randint(0, 5)):
            if result.done:
                break
            a = rng.choice(result.admissible)
            actions.append(a)
            result = original.step(a)
        again = restored.restore(game, actions)
        assert again.observation == result.observation
        assert again.admissible == result.admissible
        assert again.expert_action == result.expert_action
        restored.restore_verified(game, actions, result)


async def test_eight_envs_step_concurrently_while_loop_stays_responsive(valid_seen):
    games = valid_seen[:8]
    gaps: list[float] = []

    async def heartbeat(stop: asyncio.Event):
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def play(pool, game):
        env = pool.env()
        result, steps = await env.reset(game), 0
        while not result.done and steps < 15:
            result = await env.step(result.expert_action)
            steps += 1
        await env.close()
        return steps

    async with AsyncEnvPool(workers=2, max_steps=50) as pool:
        stop = asyncio.Event()
        beat = asyncio.create_task(heartbeat(stop))
        t0 = time.perf_counter()
        steps = await asyncio.gather(*(play(pool, g) for g in games))
        elapsed = time.perf_counter() - t0
        stop.set()
        await beat
    assert sum(steps) >= 8
    # the loop never stalled on an env step: every heartbeat came back within 0.25 s
    assert len(gaps) > elapsed / 0.05
    assert max(gaps) < 0.25, f"event loop blocked for {max(gaps):.3f}s"


async def test_workers_outlive_a_group_sigterm_and_close_kills_a_busy_one(valid_seen):
    """honcho signals the whole process group: the actor, not the signal, ends its env workers.
    A worker busy in a call when the pool closes is killed after the timeout, not waited for."""
    import os
    import signal

    pool = await AsyncEnvPool(workers=1, max_steps=10).start()
    env = pool.env()
    await env.reset(valid_seen[0])
    proc = pool._workers[0].process
    os.kill(proc.pid, signal.SIGTERM)
    await asyncio.sleep(0.3)
    assert proc.is_alive()
    assert (await env.step("look")).observation  # and still serves
    busy = asyncio.ensure_future(env.reset(valid_seen[1]))  # a reset takes a few hundred ms
    await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await pool.close(timeout=0.05)
    assert time.monotonic() - t0 < 1.0 and not proc.is_alive()
    with pytest.raises(EnvWorkerError, match="pool closed"):
        await asyncio.wait_for(busy, 1)  # its caller hears of it instead of hanging


async def test_a_killed_worker_is_replaced_and_past_the_budget_the_pool_gives_up(valid_seen):
    """kill -9 of an env worker: the call it was serving fails once, the next call of each of its
    environments gets one replacement worker (the dead one reaped), and past ``max_restarts`` calls
    raise :class:`EnvPoolExhausted` instead of failing for ever."""
    import os
    import signal

    from comap_async.envs.pool import EnvPoolExhausted

    async with AsyncEnvPool(workers=1, max_steps=10, max_restarts=1) as pool:
        env, branch = pool.env(), pool.env()
        await env.reset(valid_seen[0])
        await branch.reset(valid_seen[1])
        first = pool._workers[0].process
        busy = asyncio.ensure_future(env.reset(valid_seen[2]))  # in flight when the worker dies
        await asyncio.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
        with pytest.raises(EnvWorkerError, match="died"):
            await asyncio.wait_for(busy, 10)
        assert (await env.reset(valid_seen[0])).observation  # a fresh worker serves it
        assert (await branch.reset(valid_seen[1])).observation  # the same replacement, not a second one
        assert pool.restarts == 1 and pool._workers[0].process is not first
        assert first.exitcode == -signal.SIGKILL  # reaped: no zombie left behind
        os.kill(pool._workers[0].process.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        with pytest.raises(EnvPoolExhausted, match="restart budget 1"):
            await env.step("look")


async def test_an_idle_environment_on_a_killed_worker_fails_its_next_step_once_naming_the_death(valid_seen):
    """An environment whose worker was killed while it waited between steps (another episode's
    call was the one in flight) lost its game with the worker: its next step fails once with the
    death named (not the replacement worker's "step() before reset()"), and a reset plays again."""
    import os
    import signal

    async with AsyncEnvPool(workers=1, max_steps=10, max_restarts=2) as pool:
        idle = pool.env()
        await idle.reset(valid_seen[0])
        os.kill(pool._workers[0].process.pid, signal.SIGKILL)
        for _ in range(100):  # the pool reads the worker's EOF on the loop
            if pool._workers[0].dead:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(EnvWorkerError, match=r"died .*the game this environment was playing is lost") as err:
            await idle.step("look")
        assert "before reset" not in str(err.value)
        assert (await idle.reset(valid_seen[0])).observation
        assert (await idle.step("look")).observation
