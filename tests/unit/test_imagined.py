"""Imagined episodes' filter and storage as pure logic: the critic's score decides what
is kept, the broker files the kept steps in their own store as the policy's draft data."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest.mock import patch

import msgpack
from msgspec.structs import replace as msgspec_replace

from actors.imagined import ImaginedRollouts
from comap_async.config import CoMapConfig
from comap_async.prompts import Conversation
from comap_async.wire.messages import Imagined, TurnDemos


class ScriptedLLM:
    """Drafts ``go to desk <n>``; the world model answers ``You arrive at desk <n>.``; the critic
    scores an imagined episode by its first action (``scores``)."""

    prompts = None  # no token counter: nothing of a turns path is left out

    def __init__(self, scores):
        self.scores, self.n, self.critic_calls, self.seen = scores, 0, [], []

    async def draft(self, state, temperature=None):
        self.n += 1
        self.seen.append(state)
        return f"go to desk {self.n}", None

    async def imagine(self, state, action, conversation=None):
        return f"You arrive at desk {action.rsplit(' ', 1)[1]}."

    async def critic(self, state, trajectory):
        self.critic_calls.append(trajectory)
        return self.scores[trajectory[0][0]]

    def last_version(self, role):
        return 3


def episode(steps: int):
    history = [(f"real {i}", f"You see thing {i}.") for i in range(steps)]
    return SimpleNamespace(
        id="a:e1",
        task="put a mug on desk",
        first_observation="You are in a room.",
        history=history,
        game=SimpleNamespace(name="g"),
        stats=SimpleNamespace(steps=steps, imagined_kept=0, imagined_dropped=0, imagined_scores=[]),
        observation_at=lambda t: history[t - 1][1] if t else "You are in a room.",
        location_at=lambda t: "",  # ALFWorld gives none
    )


async def play(min_score: float, scores: dict, steps: int = 5, rollouts: int = 3, depth: int = 2, turns=False):
    """Imagined episodes of ``depth`` steps kept from ``min_score`` (the method's constants, patched)."""
    cfg = CoMapConfig.model_validate(
        {"env": {"prompt_form": "draft_turns" if turns else "window"}, "actor": {"imagined_rollouts": rollouts}}
    )
    sent, llm = [], ScriptedLLM(scores)

    async def emit(msg):
        sent.append(msg)

    ep = episode(steps)
    ctx = SimpleNamespace(cfg=cfg, llm=llm, emit=emit, actor="a")
    with patch.multiple("actors.imagined", DEPTH=depth, MIN_SCORE=min_score):
        await ImaginedRollouts(ctx, ep).finish()  # after the episode
    return sent, ep, llm


async def test_every_imagined_episode_is_kept_without_a_critic_at_min_score_zero():
    sent, ep, llm = await play(0.0, {})
    assert ep.stats.imagined_kept == 3 and not llm.critic_calls
    assert len(sent) == 6 and all(type(m) is Imagined and m.score is None for m in sent)
    starts = sorted({m.t for m in sent})
    assert len(starts) == 3 and all(0 <= t < 5 for t in starts)
    first, second = sorted((m for m in sent if m.t == starts[0]), key=lambda m: m.k)
    # step 0 is the real state's; step 1's state ends with the world model's answer to step 0
    assert (
        second.s.rstrip().endswith(f"You arrive at desk {first.target.rsplit(' ', 1)[1]}.")
        or f"You arrive at desk {first.target.rsplit(' ', 1)[1]}." in second.s
    )
    assert first.target in second.s and first.target not in first.s


async def test_the_critic_keeps_what_it_scores_at_least_min_score_and_drops_unread_scores():
    scores = {"go to desk 1": 0.9, "go to desk 2": 0.6, "go to desk 3": 0.3, "go to desk 4": None}
    # three rollouts of depth 1 draft desks 1, 2, 3 in order (gathered: each drafts before awaiting)
    sent, ep, llm = await play(0.5, scores, rollouts=3, depth=1)
    assert len(llm.critic_calls) == 3
    assert sorted(m.target for m in sent) == ["go to desk 1", "go to desk 2"]
    assert {m.score for m in sent} == {0.9, 0.6}
    assert (ep.stats.imagined_kept, ep.stats.imagined_dropped) == (2, 1)
    assert sorted(ep.stats.imagined_scores) == [0.3, 0.6, 0.9]  # every score read, the dropped one too


async def test_a_rollout_goes_out_while_its_episode_is_still_running_and_a_short_episode_keeps_its_count(
    monkeypatch,
):
    """On a CPU a 50-step episode outlasts a 20-minute fork: rollouts start when the real episode
    reaches their drawn steps and are sent when they end, not held back to the episode's end."""
    monkeypatch.setattr("actors.imagined.DEPTH", 1)
    monkeypatch.setattr("actors.imagined.MIN_SCORE", 0)
    cfg = CoMapConfig.model_validate({"env": {"max_steps": 6}, "actor": {"imagined_rollouts": 6}})
    sent = []

    async def emit(msg):
        sent.append(msg)

    ep = episode(6)
    ep.stats.steps = 0
    rollouts = ImaginedRollouts(SimpleNamespace(cfg=cfg, llm=ScriptedLLM({}), emit=emit, actor="a"), ep)
    for t in range(3):  # the real episode's first three steps; every step is drawn (6 of 6)
        rollouts.at(t)
        ep.stats.steps = t + 1
        await asyncio.sleep(0)
    assert sorted(m.t for m in sent) == [0, 1, 2]  # out before the episode's end
    await rollouts.finish()  # it ended after 3 steps: the 3 drawn past it start from played steps not used
    assert sorted(m.t for m in sent) == [0, 1, 2] and ep.stats.imagined_kept == 3

    ep, sent[:] = episode(6), []
    ep.stats.steps = 2
    cut = ImaginedRollouts(SimpleNamespace(cfg=cfg, llm=ScriptedLLM({}), emit=emit, actor="a"), ep)
    cut.at(0)
    cut.cancel()  # the episode failed before its rollout's first await: nothing of it goes out
    await asyncio.sleep(0)
    assert sent == [] and all(task.cancelled() for task in cut.tasks)


def test_the_broker_files_an_imagined_step_in_its_own_store_as_draft_data():
    from broker.ingest import Ingest

    msg = Imagined(
        seq=1,
        id="a:e1:2:i0",
        actor="a",
        game="g",
        episode="a:e1",
        t=2,
        k=0,
        goal="put a mug on desk",
        s="state",
        target="go to desk 1",
        score=0.8,
        policy_version=3,
        wm_version=3,
        ts=1.0,
    )
    item = Ingest().prepare(msg, b"raw")
    assert [store for store, _ in item.records] == ["imagined"] and item.counters == {"stored_imagined": 1}
    rec = msgpack.unpackb(item.records[0][1])
    assert (rec["s"], rec["target"], rec["source"], rec["policy_version"]) == ("state", "go to desk 1", "imagined", 3)


def test_a_run_records_the_related_methods_switches_and_the_table_names_them(tmp_path):
    from comap_async.config import load_config
    from comap_async.run_files import read_run_ablation, read_run_methods, write_run_ablation
    from evaluator.compare_report import run_label

    assert load_config(None).method_switches == []
    # the rollouts are the switch: co-evolution then trains on them (comap_async.method.phases.IMAGINED_DEMO_SHARE)
    assert load_config(None, ["actor.imagined_rollouts=2"]).method_switches == ["imagined_episodes"]
    cfg = load_config(None, ["actor.imagined_rollouts=2", "learner.policy_wm_aux=0.1"])
    assert cfg.method_switches == ["imagined_episodes", "paw"]
    write_run_ablation(tmp_path, ["frozen_wm"], cfg.method_switches)
    assert read_run_ablation(tmp_path) == ["frozen_wm"] and read_run_methods(tmp_path) == ["imagined_episodes", "paw"]
    assert run_label(["frozen_wm"], "r1", ["imagined_episodes"]) == "ablation frozen_wm + imagined_episodes (r1)"
    assert run_label([], "r0") == "CoMap (r0)"


async def test_in_the_turns_form_an_imagined_episode_is_one_path_its_draft_seeing_the_real_turns_then_its_own():
    sent, ep, llm = await play(0.0, {}, turns=True)
    assert ep.stats.imagined_kept == 3 and len(sent) == 3 and all(type(m) is TurnDemos and m.imagined for m in sent)
    for m in sent:
        t = int(m.id.split(":")[-2])
        real, imagined = [tuple(x) for x in m.turns[:t]], [tuple(x) for x in m.turns[t:]]
        assert real == ep.history[:t] and m.targets == [False] * t + [True] * 2 and m.first == ep.first_observation
        # each imagined action is the world model's answered draft, and the next draft saw that answer
        assert [o for _, o in imagined] == [f"You arrive at desk {a.rsplit(' ', 1)[1]}." for a, _ in imagined]
        seen = [c for c in llm.seen if isinstance(c, Conversation) and c.turns[:t] == tuple(ep.history[:t])]
        assert Conversation(ep.task, ep.first_observation, (*ep.history[:t], imagined[0])) in seen
    assert all(isinstance(c, Conversation) for c in llm.seen)


def test_the_broker_files_an_imagined_path_in_the_imagined_store_not_the_demonstrations():
    from broker.ingest import Ingest

    msg = TurnDemos(
        seq=1,
        id="a:e1:2:i",
        actor="a",
        game="g",
        episode="a:e1",
        goal="put a mug on desk",
        first="You are in a room.",
        turns=[("real 0", "You see thing 0."), ("go to desk 1", "You arrive at desk 1.")],
        targets=[False, True],
        imagined=True,
        score=0.7,
        policy_version=3,
        wm_version=3,
        ts=1.0,
    )
    item = Ingest().prepare(msg, b"raw")
    assert [store for store, _ in item.records] == ["imagined"] and item.counters == {"stored_imagined": 1}
    rec = msgpack.unpackb(item.records[0][1])
    assert rec["turns"][1] == ["go to desk 1", "You arrive at desk 1."] and rec["targets"] == [False, True]
    plain = Ingest().prepare(msgspec_replace(msg, imagined=False), b"raw")
    assert [store for store, _ in plain.records] == ["demos"]


def test_a_long_real_prefix_leaves_out_its_oldest_turns_so_the_imagined_actions_fit_the_learners_path(tiny_model_dir):
    from actors.imagined import turns_path
    from comap_async.prompts import Prompts
    from comap_async.prompts.template import FIT_LEFT_OUT_TURNS

    prompts = Prompts.for_model(tiny_model_dir, CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}}))
    llm = ScriptedLLM({})
    llm.prompts = prompts
    ep = episode(40)
    steps = [("s", "go to desk 1", "You arrive at desk 1."), ("s", "go to desk 2", "You arrive at desk 2.")]
    imagined = tuple((a, o) for _, a, o in steps)

    def tokens(turns):
        return prompts.count_tokens(prompts.turns_prompt(Conversation(ep.task, ep.first_observation, turns), fit=False))

    # the servers' prompt limit (a learner's path cap) halfway between the imagined turns alone and the whole
    # episode with them
    limit = (tokens(imagined) + tokens((*ep.history, *imagined))) // 2
    cfg = CoMapConfig.model_validate({"env": {"prompt_form": "draft_turns"}, "inference": {"max_prompt_tokens": limit}})
    path = turns_path(SimpleNamespace(cfg=cfg, llm=llm, actor="a"), ep, 40, steps, None)
    kept = len(path.turns) - 2
    assert 0 < kept < 40 and (40 - kept) % FIT_LEFT_OUT_TURNS == 0
    assert [tuple(x) for x in path.turns[:kept]] == ep.history[40 - kept :]
    assert path.targets == [False] * kept + [True, True]
    assert tokens(tuple(tuple(x) for x in path.turns)) <= limit
    # no more left out than needed: with the last block left out back in, the path would not fit
    assert tokens((*ep.history[40 - kept - FIT_LEFT_OUT_TURNS :], *imagined)) > limit


def test_an_episodes_metrics_carry_the_critics_scores_of_its_imagined_episodes():
    from actors.episodes import EpisodeStats

    out = EpisodeStats(imagined_kept=1, imagined_dropped=2, imagined_scores=[0.2, 0.6, 0.1]).metrics()
    assert (out["imagined_kept"], out["imagined_dropped"]) == (1.0, 2.0)
    assert abs(out["imagined_score_mean"] - 0.3) < 1e-9 and out["imagined_score_max"] == 0.6
    assert "imagined_score_mean" not in EpisodeStats(imagined_kept=3).metrics()  # min score 0: no critic asked
