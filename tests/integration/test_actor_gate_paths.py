"""The CoMap step's branches on a real ALFWorld game, with a scripted model (the model is the only stand-in).

The tiny random model almost never produces a readable REVISE decision, so the opened action gate is
exercised here: revisions toward the walkthrough are executed, refused ones are not.
"""

from __future__ import annotations

import pytest

from actors.episodes import EpisodeContext, play_coevolve
from actors.llm import Draft, Reflected
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.envs.pool import AsyncEnvPool
from comap_async.wire.messages import Registry
from comap_async.wire.protocol import as_map, validate

pytestmark = pytest.mark.alfworld


class ScriptedLLM:
    """Drafts 'look'; reflects with a confident revision to the walkthrough action on even steps."""

    def __init__(self, plan: list[str]) -> None:
        self.plan, self.t, self.imagined = plan, 0, []

    async def draft(self, state):
        return "look", None

    async def draft_scored(self, state, admissible=None):
        return Draft(*await self.draft(state))

    async def imagine(self, state, action, conversation=None):
        self.imagined.append(action)
        return f"You imagine doing {action}."

    async def teacher(self, state, action, real_next, conversation=None):
        return real_next

    def last_version(self, role):
        # as if the learner published between calls: the policy served v7, and every imagine call
        # a newer world model (its index), so a transition must name the call behind each field
        return {"policy": 7, "wm": len(self.imagined)}.get(role)

    async def reflect(
        self, state, a_draft, s_hat, confidence=None, admissible=None, keep_at_or_below=None, conversation=None
    ):
        t, self.t = self.t, self.t + 1
        target = self.plan[min(t, len(self.plan) - 1)]
        if t == 5:  # nothing readable even after the continuation: the draft runs, nothing is learned
            return Reflected("KEEP", a_draft, 0.0, 0.0, "no_decision_logprob", readable=False)
        if t % 2 == 0:
            return Reflected("REVISE", target, 0.9, 0.95, None)
        return Reflected("REVISE", target, 0.9, 0.2, None)  # confident decision, unsure action: refused


async def play_scripted(
    valid_seen, alfworld_data, *overrides: str, counterfactual: bool = False, llm_class: type | None = None
):
    """One CoMap episode of the first valid_seen game with ``llm_class`` (default :class:`ScriptedLLM`):
    (what the outbox would send, the episode's stats, the config, the model). ``counterfactual``: with a
    second environment on which revised steps' drafts are taken, as the actor's training episodes have."""
    game = sorted(valid_seen, key=lambda g: g.name)[0]
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.max_steps=6", *overrides])
    sent: list[dict] = []

    async def emit(msg):
        msg.seq = len(sent)
        sent.append(as_map(validate(msg)))  # what the outbox would send

    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=6) as pool:
        env = pool.env()
        await env.reset(game)
        llm = (llm_class or ScriptedLLM)(await env.walkthrough())
        ctx = EpisodeContext("test", cfg, llm, emit, next_state, lambda: Registry(versions={"policy": 3, "wm": 2}))
        stats = await play_coevolve(ctx, env, game, "test:e1", counterfactual=pool.env() if counterfactual else None)
    return sent, stats, cfg, llm


async def test_gate_opens_and_closes_on_a_real_game(valid_seen, alfworld_data):
    sent, stats, _, llm = await play_scripted(valid_seen, alfworld_data)
    transitions = [m for m in sent if m["type"] == "transition"]
    assert transitions and sent[-1]["type"] == "episode"
    for tr in transitions:
        if tr["t"] % 2 == 0:  # revision executed; the world model imagined the executed action too
            assert tr["a_exec"] == tr["a_ref"] != "look"
            assert tr["s_hat_exec"] == f"You imagine doing {tr['a_exec']}." != tr["s_hat"]
        else:  # low q_ref or unreadable: the draft is executed and its imagined state reused
            assert tr["a_exec"] == "look" and tr["s_hat_exec"] == tr["s_hat"]
        assert tr["reflection_readable"] == (tr["t"] != 5)
        # stamped with the adapters that generated the fields, not the registry's (3, 2)
        assert tr["policy_version"] == 7
        assert llm.imagined[tr["wm_version"] - 1] == tr["a_exec"]  # the call that imagined s_hat_exec
        assert tr["s_hat_teacher"] == tr["s_next"]
    assert stats.revisions == len([t for t in transitions if t["t"] % 2 == 0])
    assert stats.revisions_played == [(t["t"], t["a_draft"], t["a_ref"]) for t in transitions if t["t"] % 2 == 0]
    assert "delta_f1" in sent[-1]["metrics"]
    assert len(transitions) == 6 and stats.gate_reasons == {"revised": 3, "low_confidence": 2, "unreadable": 1}
    assert stats.unreadable_reflections == 1 and sent[-1]["metrics"]["unreadable_reflection_rate"] == pytest.approx(
        1 / 6
    )


async def test_a_revised_steps_draft_is_taken_on_a_branch_for_its_real_next_state(valid_seen, alfworld_data):
    """Training: on each revised step the draft's own real next observation (``s_next_draft``), taken
    on a second environment restored to the step's state, is what the world-state gate shows when it
    doubts the imagined state; kept steps carry none, and the episode itself plays as without it."""
    plain, _, _, _ = await play_scripted(valid_seen, alfworld_data)
    sent, stats, _, _ = await play_scripted(valid_seen, alfworld_data, counterfactual=True)
    transitions = [m for m in sent if m["type"] == "transition"]
    assert [(t["a_exec"], t["s_next"]) for t in transitions] == [
        (t["a_exec"], t["s_next"]) for t in plain if t["type"] == "transition"
    ]
    game = sorted(valid_seen, key=lambda g: g.name)[0]
    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=6) as pool:
        replay = pool.env()
        for tr in transitions:
            if tr["a_exec"] != tr["a_draft"]:
                await replay.restore(game, [t["a_exec"] for t in transitions[: tr["t"]]])
                assert tr["s_next_draft"] == (await replay.step(tr["a_draft"])).observation != tr["s_next"]
            else:
                assert tr.get("s_next_draft") is None
    assert sum(t.get("s_next_draft") is not None for t in transitions) == stats.revisions == 3
    assert stats.restore_diverged == 0


async def test_the_oracle_loop_reflects_on_the_drafts_true_next_state(valid_seen, alfworld_data):
    """``comap_oracle``: the reflection is shown the draft's real next observation, taken on another
    environment restored to the step, and the world model is not asked about the draft."""
    game = sorted(valid_seen, key=lambda g: g.name)[0]
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.max_steps=4"])
    shown: list[str] = []

    class Recording(ScriptedLLM):
        async def reflect(self, state, a_draft, s_hat, *args, **kw):
            shown.append(s_hat)
            return await super().reflect(state, a_draft, s_hat, *args, **kw)

    async def emit(msg):
        return None

    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=4) as pool:
        env, oracle, replay = pool.env(), pool.env(), pool.env()
        await env.reset(game)
        llm = Recording(await env.walkthrough())
        ctx = EpisodeContext("test", cfg, llm, emit, next_state, lambda: Registry(versions={"policy": 3, "wm": 2}))
        stats = await play_coevolve(ctx, env, game, "test:e1", eval_mode=True, oracle=oracle)
        truth = []
        prefix: list[str] = []
        for t in range(len(shown)):
            await replay.restore(game, prefix)
            truth.append((await replay.step("look")).observation)  # every draft is 'look'
            prefix.append(llm.plan[t] if t % 2 == 0 and t != 5 else "look")
    assert shown == truth and len(shown) == stats.steps == 4
    assert llm.imagined == [llm.plan[t] for t in range(4) if t % 2 == 0]  # only the executed revisions
    assert stats.delta_f1 == []  # the world model predicted none of the drafts: nothing to score


class PlanFollower:
    """Follows the walkthrough, either by drafting it or by revising a 'look' draft toward it."""

    def __init__(self, plan: list[str], revise_to_plan: bool) -> None:
        self.plan, self.t, self.revise_to_plan = plan, 0, revise_to_plan

    def _next(self) -> str:
        return self.plan[min(self.t, len(self.plan) - 1)]

    def last_version(self, role):
        return None  # the registry's versions

    async def draft(self, state):
        return ("look" if self.revise_to_plan else self._next()), None

    async def draft_scored(self, state, admissible=None):
        return Draft(*await self.draft(state))

    async def imagine(self, state, action, conversation=None):
        return "Nothing happens."

    async def teacher(self, state, action, real_next, conversation=None):
        return real_next

    async def reflect(
        self, state, a_draft, s_hat, confidence=None, admissible=None, keep_at_or_below=None, conversation=None
    ):
        target, self.t = self._next(), self.t + 1
        if self.revise_to_plan:  # a confident revision to the walkthrough: executed
            return Reflected("REVISE", target, 0.9, 0.95, None)
        return Reflected("REVISE", "look", 0.9, 0.2, None)  # a bad revision the gate refuses


async def test_reflection_metrics_judge_every_step_by_two_branches(valid_seen, alfworld_data):
    """Every evaluated step gets ``(m, z_draft, z_ref)`` (docs/design.md section 11). Revising a 'look'
    draft to the walkthrough's action: executed (m = 1), and the branch it starts follows the
    walkthrough to a win (z_ref = 1). Drafting the walkthrough's action and proposing 'look': the
    gate blocks it (m = 0) and the draft's branch wins (z_draft = 1), so with no executed revision
    URR = HRR = 0 and BRP = 0 (the paper's ε)."""
    from evaluator.eval_report import reflection_summary

    game = sorted(valid_seen, key=lambda g: g.name)[1]
    cfg = load_config(None, [f"env.data_dir={alfworld_data}"])

    async def emit(msg):
        return None

    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        env, branch = pool.env(), pool.env()
        await env.reset(game)
        plan = await env.walkthrough()
        judged = {}
        for revise_to_plan in (True, False):
            ctx = EpisodeContext("test", cfg, PlanFollower(plan, revise_to_plan), emit, next_state, Registry)
            stats = await play_coevolve(ctx, env, game, f"test:r{revise_to_plan}", eval_mode=True, branch=branch)
            assert stats.won and stats.steps == len(plan)
            assert len(stats.judged_steps) == len(plan)  # every step, not only proposed revisions
            judged[revise_to_plan] = stats.judged_steps
    assert all(m == 1 and z_ref == 1 for m, _, z_ref in judged[True])
    assert all(m == 0 and z_draft == 1 for m, z_draft, _ in judged[False])
    blocked = reflection_summary(judged[False], 50)
    assert blocked["sum_m"] == 0 and (blocked["urr"], blocked["hrr"], blocked["brp"]) == (0.0, 0.0, 0.0)
    executed = reflection_summary(judged[True], 50)
    n_win_drafts = sum(z for _, z, _ in judged[True])  # 'look' detours the expert may still recover from
    assert executed["sum_z_draft"] == n_win_drafts and executed["hrr"] == 0.0
    assert executed["brp"] == pytest.approx((len(plan) - n_win_drafts) / len(plan))


class LoggingLLM(ScriptedLLM):
    """ScriptedLLM whose teacher takes a while and which logs when each call starts and ends."""

    def __init__(self, plan: list[str]) -> None:
        super().__init__(plan)
        self.log: list[str] = []

    async def draft(self, state):
        self.log.append("draft")
        return await super().draft(state)

    async def teacher(self, state, action, real_next, conversation=None):
        import asyncio

        self.log.append("teacher:start")
        await asyncio.sleep(0.05)
        self.log.append("teacher:end")
        return real_next


async def test_the_teacher_runs_beside_the_next_draft_and_each_transition_carries_its_own_steps(
    valid_seen, alfworld_data
):
    """The teacher call of step t runs beside the draft of step t+1 (the former ``actor.overlap_teacher``,
    now the only way; docs/benchmarks.md has its figure), and each transition still goes out whole, in
    step order, with its own step's teacher prediction."""
    sent, _, _, llm = await play_scripted(valid_seen, alfworld_data, llm_class=LoggingLLM)
    transitions = [m for m in sent if m["type"] == "transition"]
    assert len(sent) == 7 and sent[-1]["type"] == "episode"  # 6 transitions, then the episode
    assert [tr["t"] for tr in transitions] == list(range(6))
    # the scripted teacher answers with the real next state it is shown: each step's own
    assert all(tr["s_hat_teacher"] == tr["s_next"] for tr in transitions)
    # the next draft starts while the step before's teacher call is still out, at every step but the first
    drafts_inside_teacher = sum(
        1
        for i, e in enumerate(llm.log)
        if e == "draft" and llm.log[:i].count("teacher:start") > llm.log[:i].count("teacher:end")
    )
    assert drafts_inside_teacher == 5


async def test_no_action_gate_executes_every_revision(valid_seen, alfworld_data):
    """The ablation ``no_action_gate``: the refused revisions of the test above (confident
    decision, unsure action) are executed too; only the gate changes."""
    sent, stats, cfg, _ = await play_scripted(valid_seen, alfworld_data, "method.ablation=no_action_gate")
    transitions = [m for m in sent if m["type"] == "transition"]
    assert len(transitions) >= 2 and any(tr["q_ref"] < cfg.method.tau_q for tr in transitions)
    for tr in transitions:  # every step: a_ref differs from the draft 'look', so it is executed
        assert tr["a_exec"] == tr["a_ref"] != "look"
        assert tr["s_hat_exec"] == f"You imagine doing {tr['a_exec']}."
    assert stats.revisions == len(transitions)
