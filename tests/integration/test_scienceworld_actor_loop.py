"""ScienceWorld through the whole actor path: the real simulator, a real
broker subprocess (gates on ScienceWorld's canonical facts), the real embedded server on the tiny model."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from actors.worker import ActorWorker
from comap_async.config import load_config
from comap_async.envs.scienceworld_facts import next_state
from comap_async.logsetup import configure_logging
from comap_async.wire.messages import Transition
from comap_async.wire.protocol import validate
from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides
from tests.integration.test_actor_loop import announce, check_contiguous

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs Java 17+ (.ci/install)")
REPO = Path(__file__).resolve().parents[2]
SHORT = ["lifespan-longest-lived", "find-plant", "lifespan-shortest-lived"]  # gold sequences of 4-12 steps
ENV = ["env.name=scienceworld", "env.split=train", "env.show_admissible=false", "env.data_dir=null"]


@pytest.fixture(scope="module")
def games():
    from comap_async.envs.scienceworld_games import discover_games

    return discover_games("train", tasks=SHORT, per_task=1, seed=0)  # the actors train: never on dev or test


def sw_config(broker, server, tiny_model_dir, *extra):
    return load_config(REPO / "configs" / "test.yaml", system_overrides(broker, server, tiny_model_dir, *ENV, *extra))


async def test_warmup_gold_episodes_win_and_land_in_demos(broker_factory, roomy_server, tiny_model_dir, games):
    broker = broker_factory(ENV)  # a fresh broker is in the warm-up phase
    cfg = sw_config(broker, roomy_server, tiny_model_dir, "env.max_steps=30", "actor.warmup_explore=0.0")
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=3, episodes=3, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert sorted(g.name for g, _ in results) == sorted(g.name for g in games)
    assert [s.won for _, s in results] == [True, True, True] and worker.metrics.failures == 0
    demos, transitions, episodes = stored(broker, "demos"), stored(broker, "transitions"), stored(broker, "episodes")
    assert len(demos) == len(transitions) == sum(s.steps for _, s in results) >= 3 * 4
    assert all(d["target"] == t["a_exec"] for d, t in zip(demos, transitions))
    assert all(e["won"] and e["env"] == "scienceworld" for e in episodes)
    won = [t for t in transitions if t["won"]]
    assert len(won) == 3 and all(t["done"] and t["reward"] > 0 for t in won)
    check_contiguous(transitions, episodes)
    # every real observation of the gold runs was readable: the facts the actor sent are the state
    for t in transitions:
        assert next_state(frozenset(t["facts"]), t["s_next"]) is not None, t["s_next"][:200]


async def test_coevolve_episodes_store_complete_scored_transitions(broker_factory, roomy_server, tiny_model_dir, games):
    broker = broker_factory(ENV)
    await announce(broker, "coevolve")
    cfg = sw_config(broker, roomy_server, tiny_model_dir, "env.max_steps=3")
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=3, episodes=3, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert len(results) == 3 and worker.metrics.failures == 0
    transitions, episodes = stored(broker, "transitions"), stored(broker, "episodes")
    assert len(episodes) == 3 and len(transitions) == sum(s.steps for _, s in results) >= 3
    for tr in transitions:
        validate(tr)
        assert set(Transition.__struct_fields__) <= set(tr)
        assert tr["phase"] == "coevolve" and tr["s_hat_teacher"] is not None and tr["s_hat"] is not None
        assert tr["game"].split("/")[1] in SHORT
        assert tr["s"].startswith("Task: Your task is") and "Admissible commands" not in tr["s"]
        # the first state's facts come from the reset's room listing (this room, what is in it)
        if tr["t"] == 0:
            assert any(f.startswith("at(") for f in tr["facts"]) and any(f.startswith("in(") for f in tr["facts"])
    check_contiguous(transitions, episodes)
    readable = {tr["id"] for tr in transitions if tr["reflection_readable"]}  # the broker gated and derived each
    assert {r["id"] for r in stored(broker, "reflections")} == readable


def test_comap_eval_reports_success_rate_and_mean_score(roomy_server, tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "comap_async",
        "eval",
        "--config",
        "configs/test.yaml",
        "--split",
        "dev",
        "--per-task",
        "1",
        "--games",
        "2",
        "--method",
        "draft_only",
        "--out",
        str(tmp_path / "out"),
        "--serve",
        "never",
        "--adapters",
        "base",
    ]
    for o in [
        *ENV,
        f"env.tasks={SHORT}",
        "env.max_steps=3",
        f"model.name_or_path={tiny_model_dir}",
        f"inference.endpoints=['{roomy_server.url}']",
        f"run.root={tmp_path / 'runs'}",
    ]:
        cmd += ["--set", o]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["split"] == "dev" and report["games"] == 2 and report["method"] == "draft_only"
    assert {e["game"].split("/")[1] for e in report["episodes"]} <= set(SHORT)
    assert all(0.0 <= e["score"] <= 100.0 for e in report["episodes"])  # a failed task counts 0, not -100
    assert report["mean_score"] == sum(e["score"] for e in report["episodes"]) / 2
    assert "mean score" in r.stdout and "success rate" in r.stdout


TURNS = [*ENV, "env.prompt_form=draft_turns"]


async def test_turns_warmup_stores_each_gold_path_whole(broker_factory, roomy_server, tiny_model_dir, games):
    """The ALFWorld CPU recipe's prompt form on ScienceWorld: each gold run goes to the demos store as
    one path of chat turns (its observations the simulator's own), no step as its own demonstration."""
    broker = broker_factory(TURNS)
    cfg = sw_config(broker, roomy_server, tiny_model_dir, "env.prompt_form=draft_turns", "env.max_steps=30")
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=3, episodes=3, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert [s.won for _, s in results] == [True, True, True] and worker.metrics.failures == 0
    demos, transitions = stored(broker, "demos"), stored(broker, "transitions")
    assert len(demos) == 3 and all(d["targets"] and all(d["targets"]) for d in demos)
    for d in demos:
        # an explored step (for the world model, on a branch) is not on the path
        steps = sorted(
            (t for t in transitions if t["episode"] == d["episode"] and not t["explore"]), key=lambda t: t["t"]
        )
        assert [list(turn) for turn in d["turns"]] == [[t["a_exec"], t["s_next"]] for t in steps]
        assert d["goal"] in steps[0]["s"] and d["first"]
    assert broker.stats()["counters"]["stored_turn_demos"] == 3


async def test_turns_coevolve_drafts_are_valid_commands_under_admissible_choice(
    broker_factory, roomy_server, tiny_model_dir, games
):
    """Decoded among ScienceWorld's valid commands (hundreds per state), the random tiny policy's
    actions are all executable: the choice list reaches the server whole and the decoding keeps to it."""
    broker = broker_factory([*TURNS, "actor.admissible_choice=true"])
    await announce(broker, "coevolve")
    cfg = sw_config(
        broker,
        roomy_server,
        tiny_model_dir,
        "env.prompt_form=draft_turns",
        "actor.admissible_choice=true",
        "env.max_steps=3",
    )
    worker = ActorWorker(cfg, configure_logging("actor-test"), envs=3, episodes=3, games=games)
    results = await asyncio.wait_for(worker.run(), timeout=300)
    assert len(results) == 3 and worker.metrics.failures == 0
    transitions, episodes = stored(broker, "transitions"), stored(broker, "episodes")
    assert len(transitions) == sum(s.steps for _, s in results) >= 3
    # the actor counts an executed action outside the state's valid list as invalid
    assert len(episodes) == 3 and all(e["metrics"]["invalid_rate"] == 0 for e in episodes), episodes
    # (not that each one acts: the simulator's valid list holds combinations its parser refuses, e.g.
    # "move sewer to foundry" -> "No known action matches that input.")
