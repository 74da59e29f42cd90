"""Processes of one run refuse a peer running another method: the broker's registry
(every ack, every reply to an announce) carries its fingerprint; a learner started with another
config stops with one line before it trains, an actor before it plays an episode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.worker import ActorWorker
from comap_async.config import load_config
from comap_async.logsetup import configure_logging
from comap_async.method.fingerprint import MethodMismatch, fingerprint
from comap_async.wire.broker_client import BrokerClient
from learner.loop import Learner
from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides

REPO = Path(__file__).resolve().parents[2]


async def test_a_process_with_another_method_is_refused(broker_factory, roomy_server, tiny_model_dir, alfworld_data):
    broker = broker_factory(["method.ablation=frozen_wm"])
    frozen = load_config(None, ["method.ablation=frozen_wm"])
    plain = load_config(
        REPO / "configs" / "test.yaml",
        system_overrides(broker, roomy_server, tiny_model_dir, f"env.data_dir={alfworld_data}"),
    )
    async with BrokerClient(broker.learner_endpoint) as bc:
        assert (await bc.get_registry())["method"] == fingerprint(frozen)
        registry = await bc.announce("coevolve", {"policy": 0, "wm": 0, "wm_teacher": 0}, {}, 0)
        assert registry["method"] == fingerprint(frozen) and registry["phase"] == "coevolve"
    with pytest.raises(MethodMismatch, match="the broker runs method"):
        await asyncio.wait_for(Learner(plain, configure_logging("learner-test")).run(max_steps=1), timeout=120)
    worker = ActorWorker(plain, configure_logging("actor-test"), envs=1, episodes=1)
    with pytest.raises(MethodMismatch, match="the broker runs method"):
        await asyncio.wait_for(worker.run(), timeout=120)
    assert stored(broker, "transitions") == []  # refused before it played
