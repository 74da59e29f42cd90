"""``env.draft_turns`` warm-up on real games: the actor sends each played path (the walkthrough, and
each recovery branch) as one ``turn_demos`` message, its transitions carry no per-step demonstration,
and through a real broker the paths are what the ``demos`` store holds."""

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
from comap_async.prompts import ChatTemplate, Conversation, Prompts
from comap_async.wire.messages import Registry
from comap_async.wire.protocol import as_map, validate
from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def check_paths(sent: list[dict]) -> tuple[dict, list[dict]]:
    """(the walkthrough's path, the recovery paths), after checking each against the transitions."""
    transitions = [m for m in sent if m["type"] == "transition"]
    paths = {m["id"]: {**m, "turns": [list(t) for t in m["turns"]]} for m in sent if m["type"] == "turn_demos"}
    # an explored step never was a demonstration; the others' demonstrations are in the paths
    assert transitions and all(m.get("step_demo") is False for m in transitions if not m.get("explore"))
    expert = [m for m in transitions if not m.get("explore") and not m.get("recovery")]
    explore = {m["id"]: m for m in transitions if m.get("explore")}
    walk = paths.pop(expert[0]["episode"])
    assert walk["turns"] == [[m["a_exec"], m["s_next"]] for m in expert] and all(walk["targets"])
    recoveries = []
    for r in (m for m in transitions if m.get("recovery")):
        path = paths.pop(r["id"])
        x, t = explore[r["id"].removesuffix(":r") + ":x"], r["t"]
        # the expert's path to step t and its actions learned again, the explored step as context, then the expert
        assert path["turns"] == walk["turns"][:t] + [[x["a_exec"], x["s_next"]], [r["a_exec"], r["s_next"]]]
        assert path["targets"] == [True] * t + [False, True] and path["recovery"]
        recoveries.append(path)
    assert not paths  # nothing else was sent as a path
    return walk, recoveries


async def test_warmup_sends_the_walkthrough_and_each_recovery_as_one_path(alfworld_data, train_games, tiny_model_dir):
    from comap_async.models import load_model_and_tokenizer
    from learner.batches import Encoder

    cfg = load_config(
        REPO / "configs" / "test.yaml",
        [
            f"env.data_dir={alfworld_data}",
            "env.max_steps=50",
            "actor.warmup_explore=0.5",
            "env.prompt_form=draft_turns",
        ],
    )
    game = train_games[1]
    sent: list[dict] = []

    async def emit(msg):
        sent.append(as_map(validate(msg)))  # what the outbox would send

    ctx = EpisodeContext("a", cfg, None, emit, next_state, Registry)
    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        stats = await play_expert(ctx, pool.env(), game, "a:e1", branch=pool.env())
    assert stats.won
    walk, recoveries = check_paths(sent)
    assert recoveries, "no recovery branch in a whole game at share 0.5"

    # the learner's sequence of a recovery path: its last action follows the prompt an actor in the
    # off-path state would send, and the explored action carries no loss
    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    enc = Encoder(tok, Prompts(ChatTemplate.from_model_dir(tiny_model_dir)), 512, 4096)
    path = recoveries[-1]
    seq = enc.draft(path)
    off = Conversation(path["goal"], path["first"], tuple(map(tuple, path["turns"][:-1])))
    prompt, last = enc._ids(enc.prompts.draft(off)), enc._ids(path["turns"][-1][0] + enc.eos)
    assert seq.ids == prompt + last and seq.loss[-len(last) :] == [True] * len(last)
    assert enc.demo_actions == sum(path["targets"])


async def test_through_the_broker_the_demos_store_holds_the_paths(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games
):
    broker = broker_factory(["env.prompt_form=draft_turns"])  # a fresh broker is in the warmup phase; same method
    games = train_games[:2]
    cfg = load_config(
        REPO / "configs" / "test.yaml",
        system_overrides(
            broker,
            roomy_server,
            tiny_model_dir,
            f"env.data_dir={alfworld_data}",
            "env.max_steps=50",
            "actor.warmup_explore=1.0",
            "env.prompt_form=draft_turns",
        ),
    )
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=2, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert [s.won for _, s in results] == [True] * 2 and worker.metrics.failures == 0
    demos, transitions = stored(broker, "demos"), stored(broker, "transitions")
    counters = broker.stats()["counters"]
    recovery = [t for t in transitions if t.get("recovery")]
    assert all("turns" in d for d in demos) and len(demos) == 2 + len(recovery)
    assert counters["stored_turn_demos"] == len(demos) and "stored_demos" not in counters
    assert counters["stored_demo_turns"] == sum(sum(d["targets"]) for d in demos)
    walks = [d for d in demos if not d["recovery"]]
    assert sorted(len(d["turns"]) for d in walks) == sorted(s.steps for _, s in results)
