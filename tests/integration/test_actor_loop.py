"""Actors end to end: real broker subprocess, real embedded server (tiny model), real games."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.episodes import FALLBACK_ACTION
from actors.worker import ActorWorker
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.logsetup import configure_logging
from comap_async.method.gates import action_gate, world_state_score
from comap_async.wire.broker_client import BrokerClient
from comap_async.wire.messages import Transition
from comap_async.wire.protocol import validate
from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def actor_config(broker, server, data, tiny_model_dir, *extra):
    return load_config(
        REPO / "configs" / "test.yaml",
        system_overrides(broker, server, tiny_model_dir, f"env.data_dir={data}", *extra),
    )


async def announce(broker, phase: str) -> None:
    async with BrokerClient(broker.learner_endpoint) as bc:
        await bc.announce(phase, {"policy": 0, "wm": 0, "wm_teacher": 0}, {}, 0)


def check_contiguous(transitions: list[dict], episodes: list[dict]) -> None:
    by_ep: dict[str, list[int]] = {}
    for tr in transitions:
        if not tr.get("explore") and not tr.get("recovery"):  # warm-up's off-path ones share their step's t
            by_ep.setdefault(tr["episode"], []).append(tr["t"])
    for ep in episodes:
        ts = by_ep.get(ep["id"], [])
        assert sorted(ts) == list(range(ep["steps"])), (ep["id"], sorted(ts), ep["steps"])
    assert len({tr["id"] for tr in transitions}) == len(transitions), "duplicate transition ids stored"


@pytest.mark.parametrize("confidence", [False, True], ids=["plain", "reflect_confidence"])
async def test_coevolve_actor_stores_complete_gated_transitions(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, confidence
):
    switch = [f"actor.reflect_confidence={str(confidence).lower()}"]
    broker = broker_factory(switch)  # the broker refuses an actor of another method
    await announce(broker, "coevolve")
    cfg = actor_config(broker, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=3", *switch)
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=4, episodes=4)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert len(results) == 4 and worker.metrics.failures == 0

    transitions, episodes = stored(broker, "transitions"), stored(broker, "episodes")
    assert len(episodes) == 4 and len(transitions) == sum(s.steps for _, s in results) >= 3
    for tr in transitions:
        validate(tr)  # every field present with its wire type
        assert set(Transition.__struct_fields__) <= set(tr)  # the stored frame spells every field
        assert tr["phase"] == "coevolve" and tr["s_hat_teacher"] is not None and 0.0 <= tr["p_revise"] <= 1.0
        gate = action_gate(tr["p_revise"], tr["q_ref"], tr["a_ref"], tr["a_draft"], cfg.method.tau_p, cfg.method.tau_q)
        opened = gate.open and tr["reflection_readable"]  # an unreadable reflection executes the draft
        assert tr["a_exec"] == (tr["a_ref"] if opened else tr["a_draft"]), tr["id"]
        if not opened:
            assert tr["s_hat_exec"] == tr["s_hat"]
        # the world-state score is the actor's, measured on its fact state before the action
        before = frozenset(tr["facts"])
        assert tr["ws_score"] == world_state_score(next_state, before, tr["s_hat_exec"], tr["s_hat_teacher"])
    check_contiguous(transitions, episodes)
    # the broker derived one reflection sample per transition whose reflection could be read, none from the rest
    readable = {tr["id"] for tr in transitions if tr["reflection_readable"]}
    samples = stored(broker, "reflections")
    assert {r["id"] for r in samples} == readable
    by_id = {tr["id"]: tr for tr in transitions}
    for r in samples:  # the broker applied the threshold to the actor's score, nothing else
        assert r["ws_score"] == by_id[r["id"]]["ws_score"]
        assert r["ws_imagined"] == (r["ws_score"] >= cfg.method.tau_ws)
        assert r["draft_confidence"] == by_id[r["id"]]["draft_confidence"]  # what the learner renders
    # the draft's confidence, read from the draft call's logprobs, only with the switch
    scored = [tr["draft_confidence"] for tr in transitions if tr["draft_confidence"] is not None]
    if confidence:
        assert scored and all(0.0 < c <= 1.0 for c in scored)
        # only a draft the actor could not parse (the fallback command ran) goes without one
        assert all(tr["a_draft"] == FALLBACK_ACTION for tr in transitions if tr["draft_confidence"] is None)
    else:
        assert not scored


def check_dialogues(transitions: list[dict]) -> None:
    """Each transition's conversation is its episode's real steps before it, in order."""
    by_episode: dict[str, list[dict]] = {}
    for tr in sorted(transitions, key=lambda tr: tr["t"]):
        if not tr.get("explore") and not tr.get("recovery"):
            by_episode.setdefault(tr["episode"], []).append(tr)
    for steps in by_episode.values():
        for tr in steps:
            d = tr["dialogue"]
            assert d["task"] == tr["goal"] and d["first"] == steps[0]["o"]
            assert [tuple(turn) for turn in d["turns"]] == [(p["a_exec"], p["s_next"]) for p in steps[: tr["t"]]]
    for tr in transitions:  # an explored action left the same state as its step's
        if tr.get("explore"):
            assert tr["dialogue"] == next(p for p in by_episode[tr["episode"]] if p["t"] == tr["t"])["dialogue"]


async def test_with_turns_roles_each_step_sends_the_conversation_its_reflection_and_world_model_saw(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games
):
    """``env.prompt_form: all_turns``: every co-evolution and warm-up transition and every
    reflection-init sample carry the draft's conversation at their step: the task, the first
    observation and the executed actions with what they got, in order."""
    switches = ["env.prompt_form=all_turns"]
    broker = broker_factory(switches)
    await announce(broker, "coevolve")
    games = train_games[:2]
    cfg = actor_config(broker, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=4", *switches)
    results = await asyncio.wait_for(
        ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=2, games=games).run(), timeout=300
    )
    transitions = stored(broker, "transitions")
    assert len(transitions) == sum(s.steps for _, s in results) >= 4
    check_dialogues(transitions)
    # (a readable reflection's sample carries its transition's: tests/unit/test_role_turns.py; the tiny
    # random model's reflections are not readable)

    warm = broker_factory(switches)  # a fresh broker is in the warm-up phase
    cfg = actor_config(
        warm, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=6", *switches, "actor.warmup_explore=1.0"
    )
    await asyncio.wait_for(
        ActorWorker(cfg, configure_logging("actor-test"), envs=1, episodes=1, games=games).run(), 300
    )
    transitions = stored(warm, "transitions")
    assert any(tr.get("explore") for tr in transitions) and len(transitions) >= 4
    check_dialogues(transitions)

    init = broker_factory(switches)
    await announce(init, "reflect_init")
    cfg = actor_config(
        init, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=4", *switches,
        "actor.max_reflect_init_labels=2", "learner.phases.reflect_init.min_samples=2",
    )  # fmt: skip
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=1, episodes=2, games=games)
    run = asyncio.create_task(worker.run())
    while init.stats()["stores"]["reflections"]["count"] < 2 and not run.done():
        await asyncio.sleep(0.2)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    labelled = stored(init, "reflections")
    assert labelled
    for r in labelled:  # the expert's path to the sample's step, as the draft saw it
        t = int(r["id"].split(":")[-2])
        assert r["dialogue"]["task"] and len(r["dialogue"]["turns"]) == t


async def test_warmup_expert_episodes_win_and_land_in_demos(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games
):
    broker = broker_factory()  # a fresh broker is in the warmup phase
    games = train_games[:3]
    cfg = actor_config(broker, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=50")
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=3, episodes=3, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert [s.won for _, s in results] == [True, True, True]
    demos, transitions = stored(broker, "demos"), stored(broker, "transitions")
    # exploratory and recovery transitions: test_warmup_explore.py
    transitions = [t for t in transitions if not t.get("explore") and not t.get("recovery")]
    demos = [d for d in demos if not d["id"].endswith(":r")]
    assert len(demos) == len(transitions) == sum(s.steps for _, s in results)
    assert all(d["target"] == t["a_exec"] for d, t in zip(demos, transitions))
    assert all(t["expert_action"] for t in transitions), [
        (t["id"][-6:], t["a_exec"], t["expert_action"]) for t in transitions
    ]  # the handcoded expert's label rides along
    assert all(t["phase"] == "warmup" for t in transitions)
    assert sum(t["won"] for t in transitions) == 3  # each episode's last demonstration wins its game
    check_contiguous(transitions, stored(broker, "episodes"))


async def test_actor_survives_broker_outage_without_loss_or_duplicates(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games
):
    broker = broker_factory()
    games = train_games[3:9]
    cfg = actor_config(
        broker, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=50", "actor.ack_timeout_s=0.5"
    )
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=6, games=games)
    run = asyncio.create_task(worker.run())

    async def stored_count() -> int:
        return (await asyncio.to_thread(broker.stats))["stores"]["transitions"]["count"]

    while await stored_count() < 5:
        await asyncio.sleep(0.05)
    broker.kill()
    await asyncio.sleep(5)
    assert not run.done(), "the actor must keep its episodes alive while the broker is down"
    broker.start()
    results = await asyncio.wait_for(run, timeout=300)
    assert len(results) == 6 and worker.metrics.failures == 0
    transitions, episodes = stored(broker, "transitions"), stored(broker, "episodes")
    assert len(episodes) == 6
    assert len([t for t in transitions if not t.get("explore") and not t.get("recovery")]) == sum(
        s.steps for _, s in results
    )
    check_contiguous(transitions, episodes)


@pytest.mark.parametrize(
    "phase, share",
    [
        ("warmup", ["actor.max_warmup_episodes=1", "learner.phases.warmup.min_samples=1"]),
        ("reflect_init", ["actor.max_reflect_init_labels=1", "learner.phases.reflect_init.min_samples=1"]),
    ],
)
async def test_actor_idles_after_its_share_of_a_phase_until_the_phase_moves_on(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games, phase, share
):
    """One warm-up episode, or one reflection-init episode's labels, is this actor's share: it plays
    no second episode of the phase and goes on once the learner announces the next one."""
    broker = broker_factory()
    games = train_games[:3]
    cfg = actor_config(broker, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=3", *share)
    if phase != "warmup":  # warm-up is where a fresh broker starts
        await announce(broker, phase)
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=1, episodes=3, games=games)
    run = asyncio.create_task(worker.run())
    while not broker.stats()["stores"]["episodes"]["count"]:
        await asyncio.sleep(0.2)
    await asyncio.sleep(3)  # idle: no second episode of the phase
    assert [e["phase"] for e in stored(broker, "episodes")] == [phase] and not run.done()
    if phase == "reflect_init":
        assert len(stored(broker, "reflections")) >= 1
    await announce(broker, "coevolve")
    await asyncio.wait_for(run, timeout=300)
    assert [e["phase"] for e in stored(broker, "episodes")] == [phase, "coevolve", "coevolve"]


async def test_reflection_labels_are_asked_at_the_evaluators_priority(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games, monkeypatch
):
    """The learner waits on the labels in reflect_init: the actors' calls then carry ``eval.priority`` (a
    server's hold would stall the run behind an evaluation), and their own priority again afterwards."""
    from comap_async.wire.inference_client import InferenceClient

    asked: list[int] = []
    complete = InferenceClient.complete

    async def spy(self, *args, **kwargs):
        asked.append(self.priority)
        return await complete(self, *args, **kwargs)

    monkeypatch.setattr(InferenceClient, "complete", spy)
    broker = broker_factory()
    await announce(broker, "reflect_init")
    share = ["actor.max_reflect_init_labels=1", "learner.phases.reflect_init.min_samples=1", "eval.priority=-1"]
    cfg = actor_config(broker, roomy_server, alfworld_data, tiny_model_dir, "env.max_steps=3", *share)
    games = train_games[:2]
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=1, episodes=2, games=games)
    run = asyncio.create_task(worker.run())
    while not broker.stats()["stores"]["episodes"]["count"]:
        await asyncio.sleep(0.2)
    labelling = len(asked)
    await announce(broker, "coevolve")
    await asyncio.wait_for(run, timeout=300)
    assert [e["phase"] for e in stored(broker, "episodes")] == ["reflect_init", "coevolve"]
    assert labelling > 0 and set(asked[:labelling]) == {-1}
    assert len(asked) > labelling and set(asked[labelling:]) == {0}


async def test_an_actor_plays_past_its_warmup_share_until_the_learner_has_its_demonstrations(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, train_games
):
    """Turns form without recovery paths sends one demonstration per episode: an episode share below
    ``learner.phases.warmup.min_samples`` would leave the learner waiting for ever, so the actor plays on to it."""
    broker = broker_factory(["env.prompt_form=draft_turns"])
    games = train_games[:3]
    switches = ["env.prompt_form=draft_turns", "actor.warmup_recovery=false", "actor.max_warmup_episodes=1"]
    cfg = actor_config(
        broker,
        roomy_server,
        alfworld_data,
        tiny_model_dir,
        "env.max_steps=3",
        *switches,
        "learner.phases.warmup.min_samples=2",
    )
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=1, episodes=4, games=games)
    run = asyncio.create_task(worker.run())
    while broker.stats()["stores"]["episodes"]["count"] < 2 and not run.done():
        await asyncio.sleep(0.2)
    await asyncio.sleep(3)  # idle now: two demonstrations sent
    assert [e["phase"] for e in stored(broker, "episodes")] == ["warmup", "warmup"] and not run.done()
    assert broker.stats()["stores"]["demos"]["count"] == 2
    await announce(broker, "coevolve")
    await asyncio.wait_for(run, timeout=300)
    assert [e["phase"] for e in stored(broker, "episodes")] == ["warmup", "warmup", "coevolve", "coevolve"]


def test_a_label_cap_below_the_phase_minimum_is_refused():
    with pytest.raises(ValueError, match="max_reflect_init_labels"):
        load_config(None, ["actor.max_reflect_init_labels=10", "learner.phases.reflect_init.min_samples=64"])
