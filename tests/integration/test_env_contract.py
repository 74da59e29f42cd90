"""The environment contract: every registered environment, and a toy one named by one
config line, keeps the :class:`~comap_async.envs.base.TextEnv` protocol through the environment
pool the system uses (reset with a task, a walkthrough that wins, the expert's labels, restore by
replay, unknown commands answered, facts read from the observations, prompt wording); the toy one
also runs the actor loop against a real broker and a real embedded server."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from actors.worker import ActorWorker
from comap_async.config import load_config
from comap_async.envs import ENVS, games_from_config
from comap_async.envs.pool import AsyncEnvPool
from comap_async.envs.registry import env_spec
from comap_async.logsetup import configure_logging
from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides

TOY = "tests.fixtures.toy_env:TOY"
CONTRACT_OVERRIDES = {
    "alfworld": ["env.max_games=1"],
    "scienceworld": ["env.tasks=['lifespan-longest-lived']", "env.per_task=1"],
    TOY: [],
}


@pytest.fixture(params=[*ENVS, TOY])
def env_config(request):
    name = request.param
    extra = list(CONTRACT_OVERRIDES.get(name, []))
    if name == "alfworld":
        extra.append(f"env.data_dir={request.getfixturevalue('alfworld_data')}")
    if name == "scienceworld" and shutil.which("java") is None:
        pytest.skip("ScienceWorld needs Java 17 on PATH (bash .ci/install installs it)")
    return load_config(None, [f"env.name={name}", "env.max_steps=60", *extra])


def test_every_built_in_environment_has_contract_settings():
    assert set(ENVS) <= set(CONTRACT_OVERRIDES)  # a new registry entry gets its row here, and so this test


async def test_the_environment_keeps_the_text_env_contract(env_config):
    cfg, spec = env_config, env_spec(env_config.env.name)
    assert spec.train_split in spec.splits and spec.held_out_split in spec.splits
    assert cfg.env.split == spec.train_split and cfg.eval.split == spec.held_out_split  # the defaults
    assert spec.wording.agent and spec.wording.world
    games = games_from_config(cfg, spec.held_out_split)
    assert games and all(g.split == spec.held_out_split for g in games)
    game = games[0]
    next_state = spec.next_state()
    async with AsyncEnvPool(workers=1, env_name=cfg.env.name, max_steps=cfg.env.max_steps) as pool:
        env = pool.env()
        first = await env.reset(game)
        assert first.info.get("task") and not first.done and not first.won
        assert isinstance(first.admissible, tuple) and first.expert_action
        plan = await env.walkthrough()
        assert plan
        results = [first]
        for action in plan:
            results.append(await env.step(action))
            if results[-1].done:  # (a gold sequence may hold steps past the win: ScienceWorld's)
                break
        assert results[-1].won and results[-1].done and results[-1].reward > 0  # the walkthrough wins
        assert all(r.expert_action is None or isinstance(r.expert_action, str) for r in results)
        k = (len(results) - 1) // 2
        restored = await env.restore(game, plan[:k])  # restore by replay: the same state again
        assert restored.observation == results[k].observation and not restored.done
        odd = await env.step("xyzzy plugh")  # an unknown command is answered, not raised
        assert isinstance(odd.observation, str) and not odd.won
    facts, read = frozenset(), 0
    for r in results:
        after = next_state(facts, r.observation)
        if after is not None:
            facts, read = after, read + 1
    assert read >= len(results) / 2, f"the facts parser read {read} of {len(results)} observations"


async def test_a_toy_environment_named_by_one_line_runs_the_actor_loop(broker_factory, roomy_server, tiny_model_dir):
    one_line = f"env.name={TOY}"  # all it takes besides the toy's own module
    broker = broker_factory([one_line])
    cfg = load_config(None, system_overrides(broker, roomy_server, tiny_model_dir, one_line, "env.max_steps=3"))
    from comap_async.wire.broker_client import BrokerClient

    async with BrokerClient(broker.learner_endpoint) as bc:
        await bc.announce("coevolve", {"policy": 0, "wm": 0, "wm_teacher": 0}, {}, 0)
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=2)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert len(results) == 2 and worker.metrics.failures == 0
    transitions = stored(broker, "transitions")
    assert len(transitions) == sum(s.steps for _, s in results) >= 2
    assert {t["env"] for t in transitions} == {TOY} and all(t["game"].startswith("train/row") for t in transitions)
    assert all(t["facts"] for t in transitions)  # the toy's facts, read in the actor
    gated = broker.stats()["gates"]  # the broker derived each step's reflection sample with the toy's facts
    assert gated["action_total"] == len(transitions)
    assert gated["world_state_total"] == len(transitions) - gated["action_reasons"].get("unreadable", 0)
