"""Imagined episodes (WebEvolver's world model as a virtual environment) with the tiny
model on a real embedded server, a real broker and real valid_seen games: the policy acts and the
world model answers, no environment step is taken, the steps are stored apart and reach only the
policy's draft batches."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.worker import ActorWorker
from comap_async.envs.pool import AsyncTextEnv
from comap_async.logsetup import configure_logging
from comap_async.method.routing import store_requests
from comap_async.prompts import parse_action
from comap_async.wire.broker_client import BrokerClient
from learner.loop import LearnerState
from learner.prefetch import Prefetcher
from tests.fixtures.broker import stored
from tests.fixtures.learner import QuietLog
from tests.integration.test_actor_loop import actor_config, announce

pytestmark = pytest.mark.alfworld


@pytest.fixture
def env_steps(monkeypatch) -> list[str]:
    """The actions the real environments were stepped with (an imagined step takes none)."""
    steps: list[str] = []
    real_step = AsyncTextEnv.step

    async def counted(self, action):
        steps.append(action)
        return await real_step(self, action)

    monkeypatch.setattr(AsyncTextEnv, "step", counted)
    return steps


@pytest.fixture
def short_unfiltered(monkeypatch) -> None:
    """Imagined episodes of two steps, every one kept (no critic): the tiny model's scores decide nothing."""
    monkeypatch.setattr("actors.imagined.DEPTH", 2)
    monkeypatch.setattr("actors.imagined.MIN_SCORE", 0)


@pytest.mark.usefixtures("short_unfiltered")
async def test_imagined_steps_come_from_the_world_model_are_stored_apart_and_train_only_the_draft(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, recorded_calls, env_steps
):
    broker = broker_factory(["actor.imagined_rollouts=2"])  # the related method is the run's, every process's
    await announce(broker, "coevolve")
    cfg = actor_config(
        broker,
        roomy_server,
        alfworld_data,
        tiny_model_dir,
        "env.max_steps=3",
        "actor.imagined_rollouts=2",
    )
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=2)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    real_steps = sum(s.steps for _, s in results)
    assert len(env_steps) == real_steps  # the imagined steps took none
    transitions, imagined = stored(broker, "transitions"), stored(broker, "imagined")
    assert len(transitions) == real_steps and stored(broker, "demos") == []  # not a transition, not a demonstration
    assert sum(s.imagined_kept for _, s in results) == 4 and len(imagined) >= 4
    assert all(r["source"] == "imagined" for r in imagined)

    # every imagined step's action is a policy draft, and a deeper step's state holds the world
    # model's answer to the step before it (the virtual environment's observation)
    drafts = {parse_action(c["text"]).value for c in recorded_calls if c["kind"] == "draft"}
    answers = [c["text"].strip() for c in recorded_calls if c["kind"] == "imagine"]
    by_start: dict[str, list[dict]] = {}
    for r in imagined:
        assert r["target"] in drafts
        start, k = r["id"].rsplit(":i", 1)
        by_start.setdefault(start, []).append({**r, "k": int(k)})
    deeper = 0
    for steps in by_start.values():
        steps.sort(key=lambda r: r["k"])
        assert [r["k"] for r in steps] == list(range(len(steps)))
        for before, after in zip(steps, steps[1:]):  # the answer to the step before is the observation now
            deeper += 1
            assert f"> {before['target']}" in after["s"] or before["target"] in after["s"]
            assert any(a and a in after["s"] for a in answers)
    assert deeper > 0

    # the learner's co-evolution micro-batches: imagined steps stand in for demonstrations only
    assert [s for s, _, _ in store_requests("coevolve", 4, {"imagined": 0.0}, random.Random(0))] == [
        "demos",
        "transitions",
        "reflections",
    ]
    async with BrokerClient(broker.learner_endpoint) as bc:
        prefetch = Prefetcher(bc, LearnerState(phase="coevolve", version=0), 4, 1, 0, QuietLog(), {"imagined": 1.0})
        mb = await prefetch.fetch("coevolve")
    ids = {r["id"] for r in imagined}
    assert "imagined" not in mb and mb["demos"] and {r["id"] for r in mb["demos"]} <= ids
    assert not ids & {r.get("id") for r in mb.get("transitions", [])}


@pytest.mark.usefixtures("short_unfiltered")
async def test_in_the_turns_form_each_imagined_episode_is_one_path_trained_on_its_imagined_actions_only(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, recorded_calls, env_steps
):
    from comap_async.models import load_model_and_tokenizer
    from comap_async.prompts import ChatTemplate, Prompts
    from learner.batches import Encoder

    broker = broker_factory(["env.prompt_form=draft_turns", "actor.imagined_rollouts=2"])
    await announce(broker, "coevolve")
    cfg = actor_config(
        broker,
        roomy_server,
        alfworld_data,
        tiny_model_dir,
        "env.prompt_form=draft_turns",
        "env.max_steps=3",
        "actor.imagined_rollouts=2",
    )
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=2, episodes=2)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert len(env_steps) == sum(s.steps for _, s in results)  # the imagined steps took none
    transitions, paths = stored(broker, "transitions"), stored(broker, "imagined")
    assert stored(broker, "demos") == [] and sum(s.imagined_kept for _, s in results) == len(paths) == 4
    drafts = {parse_action(c["text"]).value for c in recorded_calls if c["kind"] == "draft"}
    _, tok = load_model_and_tokenizer(str(tiny_model_dir))
    enc = Encoder(tok, Prompts(ChatTemplate.from_model_dir(tiny_model_dir)), 512, 4096)
    for p in paths:
        assert p["imagined"] and "turns" in p
        t = p["targets"].index(True)
        real = sorted((tr for tr in transitions if tr["episode"] == p["episode"]), key=lambda tr: tr["t"])[:t]
        assert [list(x) for x in p["turns"][:t]] == [[tr["a_exec"], tr["s_next"]] for tr in real]
        imagined = [a for a, _ in p["turns"][t:]]
        assert imagined and all(a in drafts for a in imagined) and p["targets"] == [False] * t + [True] * len(imagined)
        # the learner's sequence: a loss on the imagined actions' tokens (and their end of turn) only
        seq = enc.draft(p)
        assert sum(seq.loss) == sum(len(enc._ids(a.strip() + enc.eos)) for a in imagined)

    async with BrokerClient(broker.learner_endpoint) as bc:
        prefetch = Prefetcher(bc, LearnerState(phase="coevolve", version=0), 4, 1, 0, QuietLog(), {"imagined": 1.0})
        mb = await prefetch.fetch("coevolve")
    assert mb["demos"] and {r["id"] for r in mb["demos"]} <= {p["id"] for p in paths}
