"""The learner's phases against a real broker and a real embedded server:
reflection-mode initialisation trains on reflection samples from its first step, and co-evolution
trains the world model on co-evolution transitions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from comap_async.config import load_config
from comap_async.logsetup import configure_logging
from comap_async.run_files import read_run_configs
from comap_async.wire.broker_client import BrokerClient, BrokerError
from learner.loop import Learner
from learner.threads import QuietWatch
from tests.fixtures.broker import make_transition
from tests.fixtures.system import system_overrides
from tests.integration.test_learner_e2e import fill

REPO = Path(__file__).resolve().parents[2]
STATE = "Task: put a mug in coffeemachine.\nCurrent observation: You arrive at countertop {i}."
TARGET = "take mug 1 from countertop 1"


def warmup_transitions(n: int) -> list[dict]:
    """Walkthrough steps as the warm-up actors send them: a demonstration each, no student rollout."""
    return [
        make_transition(
            i,
            actor="demo",
            phase="warmup",
            s=STATE.format(i=i),
            a_draft=TARGET,
            a_ref=TARGET,
            a_exec=TARGET,
            expert_action=TARGET,
            s_hat="",
            s_hat_exec="",
            s_hat_teacher="",
            s_next="You pick up the mug 1 from the countertop 1.",
        )
        for i in range(n)
    ]


def coevolve_transitions(n: int) -> list[dict]:
    """The policy's own steps, with the student's rollout for the executed action."""
    return [
        make_transition(
            i,
            actor="coev",
            phase="coevolve",
            s=STATE.format(i=i),
            a_exec="go to coffeemachine 1",
            s_next="You arrive at coffeemachine 1. On the coffeemachine 1, you see nothing.",
            s_hat_exec="You arrive at coffeemachine 1. On the coffeemachine 1, you see a mug 2.",
        )
        for i in range(n)
    ]


def suffix_reflections(ids: range) -> list[dict]:
    """Reflection-initialisation samples as the actors send them (labelled by suffix rollouts)."""
    return [
        {
            "v": 1,
            "type": "reflection",
            "id": f"r{i}",
            "actor": "refl",
            "game": "g",
            "s": STATE.format(i=i),
            "a_draft": "go to fridge 1" if i % 2 else TARGET,
            "s_bar": "You arrive at fridge 1." if i % 2 else "You pick up the mug 1.",
            "target": TARGET,
            "y": i % 2,
            "policy_version": 1,
            "wm_version": 1,
            "ts": time.time(),
            "label": "expert_better" if i % 2 else "equal_draft",
        }
        for i in ids
    ]


def config(broker, server, tiny_model_dir, *extra):
    return load_config(
        REPO / "configs" / "test.yaml",
        system_overrides(
            broker,
            server,
            tiny_model_dir,
            "broker.max_staleness=1000",
            "learner.batch_size=2",
            "learner.lr=0.01",
            "learner.lora_dropout=0.0",
            "learner.phases.warmup.min_samples=4",
            "learner.publish_every=100",
            "learner.checkpoint_every=100",
            *extra,
        ),
    )


async def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_every_reflect_init_step_trains_on_reflection_samples(
    broker_factory, roomy_server, tiny_model_dir, monkeypatch
):
    """Warm-up batches still queued when ``reflect_init`` begins are dropped, the phase waits for
    ``learner.phases.reflect_init.min_samples`` reflection samples, and each of its steps has reflection CE and BCE."""
    monkeypatch.setattr("learner.threads.usable_cores", lambda: 2)  # a 2-core machine, whatever this one has
    broker = broker_factory()
    await fill(broker, warmup_transitions(8))
    cfg = config(
        broker,
        roomy_server,
        tiny_model_dir,
        "learner.phases.warmup.steps=3",
        "learner.phases.reflect_init.steps=3",
        "learner.phases.reflect_init.min_samples=4",
        "model.torch_threads=1",
    )
    learner = Learner(cfg, configure_logging("learner-test"))
    learner.actors_quiet = QuietWatch(quiet_s=0.0)  # no actor here: quiet once the count is seen to stand
    run = asyncio.create_task(learner.run(max_steps=6))
    try:
        await _until(lambda: learner.state.phase == "reflect_init" or run.done(), 120, "warm-up did not end")
        await asyncio.sleep(2.0)
        assert learner.trainer.step == 3, "reflect_init trained before any reflection sample was stored"
        await fill(broker, suffix_reflections(range(2)))
        await asyncio.sleep(2.0)
        assert learner.trainer.step == 3, "reflect_init trained with fewer than its min_samples"
        await fill(broker, suffix_reflections(range(2, 6)))
        await asyncio.wait_for(run, 120)
    finally:
        learner.stop.set()
        await asyncio.gather(run, return_exceptions=True)
    hist = learner.history
    assert len(hist) == 6
    # reflect_init's first checkpoint (step 3) is pinned: a fork can redo the phase from it
    assert [p.parent.name for p in learner.ckpt_dir.glob("step-*/pinned")] == ["step-00000003"]
    for i, h in enumerate(hist[:3], 1):
        assert h["phase"] == "warmup" and h["policy/draft_ce"] > 0, (i, h)
    for i, h in enumerate(hist[3:], 4):
        assert h["phase"] == "reflect_init", (i, h)
        assert h["policy/reflect_ce"] > 0 and h["policy/bce"] > 0, (i, h)
        assert 0.0 <= h["policy/revise_label_share"] <= 1.0
    assert sum(h["learner/phase_dropped"] for h in hist[3:]) >= 1  # the queue did hold warm-up batches
    assert all(0.05 < h["learner/rss_gb"] < 64 for h in hist)  # reported with each step
    # warm-up SFT and reflection-mode initialisation on every core once the idle actors leave them, from the
    # step after the broker's count (episodes, then labels) was first read (it has not been seen to stand
    # still before); co-evolution on model.torch_threads
    assert [h["learner/torch_threads"] for h in hist] == [1, 2, 2, 1, 2, 2]
    assert torch.get_num_threads() == 2  # set, not only reported


async def test_coevolve_trains_the_world_model_on_coevolve_transitions(broker_factory, roomy_server, tiny_model_dir):
    """Two co-evolution transitions among 150 warm-up ones: every co-evolution step distils on a
    student rollout (``wm/kl`` > 0); uniform sampling over the window almost never drew one."""
    broker = broker_factory()
    await fill(broker, warmup_transitions(150) + coevolve_transitions(2) + suffix_reflections(range(2)))
    cfg = config(
        broker,
        roomy_server,
        tiny_model_dir,
        "learner.phases.warmup.steps=0",
        "learner.phases.reflect_init.steps=1",
        "learner.phases.reflect_init.min_samples=2",
    )
    learner = Learner(cfg, configure_logging("learner-test"))
    await asyncio.wait_for(learner.run(max_steps=4), 180)
    hist = learner.history
    assert [h["phase"] for h in hist] == ["reflect_init", "coevolve", "coevolve", "coevolve"]
    (start,) = read_run_configs(learner.run_dir)  # the settings it trained with, read back
    assert start["step"] == 0 and start["config"]["learner"]["phases"]["reflect_init"]["steps"] == 1
    assert start["config"]["broker"]["http_token"] is False  # tokens: whether set, never the value
    for i, h in enumerate(hist[1:], 2):
        assert h["wm/kl"] > 0 and h["wm/ce"] > 0, (i, h)
    async with BrokerClient(broker.learner_endpoint) as bc:  # the filter over the wire
        batch = await bc.sample("transitions", 8, seed=1, phases=["coevolve"])
        assert len(batch.items) == 2 and {r["phase"] for r in batch.items} == {"coevolve"}
        with pytest.raises(BrokerError, match="phases"):
            await bc.sample("transitions", 8, phases=["rounds"])
        stats = await bc.get_stats()
    assert stats["counters"]["phase_skipped_transitions"] >= 150
