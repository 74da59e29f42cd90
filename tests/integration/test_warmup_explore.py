"""World-model warm-up on real transitions that include failures, on real games:
exploratory actions run on a second environment restored to the expert path; their transitions
reach the world model's store, never the demonstrations."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.episodes import EpisodeContext
from actors.expert_play import play_expert
from actors.worker import ActorWorker
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.envs.pool import AsyncEnvPool
from comap_async.logsetup import configure_logging
from comap_async.wire.messages import Registry
from comap_async.wire.protocol import as_map, validate
from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def check_explore(transitions: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(expert transitions, explore transitions, recovery transitions), after checking each explore
    transition against the expert step it branched from, and each recovery transition against the
    explore transition it recovers from."""
    expert = {tr["id"]: tr for tr in transitions if not tr.get("explore") and not tr.get("recovery")}
    explore = {tr["id"]: tr for tr in transitions if tr.get("explore")}
    recovery = [tr for tr in transitions if tr.get("recovery")]
    for x in explore.values():
        base = expert[x["id"].removesuffix(":x")]
        assert x["id"] == f"{x['episode']}:{x['t']}:x" and x["phase"] == "warmup"
        assert (x["s"], x["o"], x["t"], x["episode"]) == (base["s"], base["o"], base["t"], base["episode"])
        assert x["a_draft"] == x["a_ref"] == x["a_exec"] != base["a_exec"]
        assert x.get("facts") == base.get("facts")  # the state before the action, as step t's own
    for r in recovery:
        x = explore[r["id"].removesuffix(":r") + ":x"]
        assert r["id"] == f"{r['episode']}:{r['t']}:r" and r["phase"] == "warmup" and not x["done"]
        # the off-path state: the explored action's result is the observation and the newest history pair
        assert r["o"] == x["s_next"] and f"> {x['a_exec']}\n" in r["s"] and r["s"] != x["s"]
        assert r["a_draft"] == r["a_exec"] == r["expert_action"]  # the handcoded expert's action from there
    return list(expert.values()), list(explore.values()), recovery


async def test_play_expert_explores_on_the_branch_reproducibly(alfworld_data, train_games):
    cfg = load_config(
        REPO / "configs" / "test.yaml",
        [f"env.data_dir={alfworld_data}", "env.max_steps=50", "actor.warmup_explore=0.5"],
    )
    game = train_games[1]

    async def play(branch_too: bool) -> list[dict]:
        sent: list[dict] = []

        async def emit(msg):
            sent.append(as_map(validate(msg)))  # what the outbox would send

        ctx = EpisodeContext("a", cfg, None, emit, next_state, Registry)
        async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
            stats = await play_expert(ctx, pool.env(), game, "a:e1", branch=pool.env() if branch_too else None)
        assert stats.won
        return [m for m in sent if m["type"] == "transition"]

    first, again, plain = await play(True), await play(True), await play(False)
    key = [(m["id"], m["a_exec"], m["s_next"], m["done"]) for m in first]
    assert key == [(m["id"], m["a_exec"], m["s_next"], m["done"]) for m in again]  # seeded by run seed + episode id
    expert, explore, recovery = check_explore(first)
    assert explore, "no exploratory step in a whole game at share 0.5"
    assert len(recovery) == sum(not x["done"] for x in explore)  # one per explored step the game survived
    # the expert path is the one played without exploration, step for step
    assert [(m["id"], m["a_exec"], m["s_next"]) for m in expert] == [(m["id"], m["a_exec"], m["s_next"]) for m in plain]
    assert not any(m.get("explore") for m in plain)


async def test_warmup_stores_explore_transitions_outside_demos(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games
):
    broker = broker_factory()  # a fresh broker is in the warmup phase
    games = train_games[:4]
    cfg = load_config(
        REPO / "configs" / "test.yaml",
        system_overrides(
            broker,
            roomy_server,
            tiny_model_dir,
            f"env.data_dir={alfworld_data}",
            "env.max_steps=50",
            "actor.warmup_explore=1.0",
        ),
    )  # these games are short: explore at every step
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=4, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert [s.won for _, s in results] == [True] * 4 and worker.metrics.failures == 0

    transitions, demos = stored(broker, "transitions"), stored(broker, "demos")
    for tr in transitions:
        validate({**tr, "seq": 0})
    expert, explore, recovery = check_explore(transitions)
    counters = broker.stats()["counters"]
    assert len(expert) + len(recovery) == len(demos) and len(expert) == sum(s.steps for _, s in results)
    assert len(explore) == len(expert) and counters["stored_explore"] == len(explore)
    assert recovery and counters["stored_recovery"] == len(recovery)
    # real failures the walkthrough never shows, recorded as the game answered them
    assert any(x["s_next"] == "Nothing happens." for x in explore)
    assert any(x["s_next"] != "Nothing happens." for x in explore)
    assert not any(x["won"] for x in explore) or all(x["done"] for x in explore if x["won"])
    # demonstrations stay the expert's actions: one per expert step, none from an exploratory one
    explore_ids = {x["id"] for x in explore}
    assert not explore_ids & {d["id"] for d in demos}
    by_id = {tr["id"]: tr for tr in expert + recovery}
    assert all(d["target"] == by_id[d["id"]]["a_exec"] for d in demos)
    assert all(d["s"] == by_id[d["id"]]["s"] for d in demos)  # a recovery demonstration shows the off-path state
