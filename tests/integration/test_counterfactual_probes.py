"""Counterfactual probes on a real ALFWorld game, with scripted models (the model is the only stand-in):
each walkthrough state's draft, and each draft the policy's own play executed, is reflected on under
four futures, and the figures tell a reflection that reads the future it is shown from one that
ignores it."""

from __future__ import annotations

import dataclasses

import pytest

from actors.branches import expert_plan_action
from actors.episodes import Episode, EpisodeContext
from actors.llm import Draft, Reflected
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.envs.pool import AsyncEnvPool
from comap_async.method.gates import canonical_action
from comap_async.wire.messages import Registry
from evaluator.counterfactual import counterfactual_game, counterfactual_lines, summarize_counterfactual

pytestmark = pytest.mark.alfworld

BAD = "take nothing 9 from nowhere 9"  # a command the game cannot carry out: "Nothing happens."


class Scripted:
    """Drafts the expert's action, then ``look``, then an impossible command, in turn; reflects with
    a revision toward the expert's action. ``reads``: ``p`` follows the future shown (0.9 after a
    failure answer, 0.1 after anything else, 0.5 with none); otherwise ``p`` is 0.3 whatever it is.

    The walkthrough's states are drafted first, one per walkthrough action; the drafts after them are
    the policy's own play, in the same turn with the walkthrough's next action in the first place
    (``played``: each one executed; ``shown_played``: per state, the futures then shown), and their
    reflections revise toward the walkthrough's last action."""

    def __init__(self, plan: list[str], reads: bool) -> None:
        self.plan, self.reads, self.t, self.shown = plan, reads, -1, []
        self.played: list[str] = []
        self.shown_played: dict[str, list[str | None]] = {}

    async def draft_scored(self, state, admissible=None):
        self.t += 1
        if self.t < len(self.plan):
            return Draft((self.plan[self.t], "look", BAD)[self.t % 3], None)
        i = len(self.played)
        self.played.append((self.plan[min(i // 3, len(self.plan) - 1)], "look", BAD)[i % 3])
        return Draft(self.played[-1], None)

    async def imagine(self, state, action, conversation=None):
        return "You imagine it works."

    async def reflect(self, state, a_draft, s_hat, confidence=None, admissible=None, conversation=None, **kw):
        self.shown.append(s_hat)
        if self.played:
            self.shown_played.setdefault(state, []).append(s_hat)
        if not self.reads:
            p = 0.3
        elif s_hat is None:
            p = 0.5
        else:
            p = 0.9 if s_hat.strip() == "Nothing happens." else 0.1
        a_ref = self.plan[min(self.t, len(self.plan) - 1)]
        return Reflected("REVISE" if p > 0.5 else "KEEP", a_ref, p, 0.9, None)


async def probe(valid_seen, alfworld_data, reads: bool, replay=None):
    """The rows of one game's probes; ``replay(env, branch, game, ctx, llm)`` then runs on the same
    environments."""
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.max_steps=50"])

    async def emit(msg):
        return None

    async with AsyncEnvPool(workers=1, env_name="alfworld", max_steps=50) as pool:
        env, branch = pool.env(), pool.env()
        for game in sorted(valid_seen, key=lambda g: g.name):
            await env.reset(game)
            plan = await env.walkthrough()
            if len(plan) >= 6:  # each kind of draft twice
                break
        llm = Scripted(plan, reads)
        ctx = EpisodeContext("test", cfg, llm, emit, next_state, lambda: Registry.serving(0))
        rows = await counterfactual_game(ctx, env, branch, game, seed=0)
        if replay is not None:
            await replay(env, branch, game, ctx, llm)
    return rows, llm


def walkthrough_rows(rows):
    return [r for r in rows if r.kind == "walkthrough"]


async def test_a_reflection_that_reads_the_future_moves_p_between_the_futures(valid_seen, alfworld_data):
    rows, llm = await probe(valid_seen, alfworld_data, reads=True)
    rows = walkthrough_rows(rows)
    assert len(rows) == len(llm.plan) >= 6
    for r in rows:
        kind = r.t % 3
        assert r.draft_match == (kind == 0)
        assert r.draft_fails == (kind == 2)  # the impossible command, really answered as a failure
        assert r.p["imagined"] == 0.1 and r.p["none"] == 0.5
        if kind == 0:  # right: its real answer is a success; contradicted by the failure answer
            assert (r.p["real"], r.p["contradicting"]) == (0.1, 0.9)
        elif kind == 2:  # failing: its real answer is the failure; contradicted by the expert's success
            assert (r.p["real"], r.p["contradicting"]) == (0.9, 0.1)
            assert r.revised["real"] and r.executed_match["real"] and not r.executed_match["imagined"]
    s = summarize_counterfactual(rows)
    assert s["failing_drafts"] == len([r for r in rows if r.t % 3 == 2])
    real, none = s["futures"]["real"], s["futures"]["none"]
    assert real["p_auc_wrong"] > none["p_auc_wrong"] == 0.5  # the oracle future ranks wrong drafts
    assert s["against_imagined"]["contradicting"]["right"]["mean_abs_delta_p"] == pytest.approx(0.8)
    assert s["against_imagined"]["real"]["all"]["decision_flips"] == s["failing_drafts"]
    assert None in llm.shown  # the "none" future really showed no imagined state


async def test_a_reflection_that_ignores_the_future_gives_no_delta(valid_seen, alfworld_data):
    rows, _ = await probe(valid_seen, alfworld_data, reads=False)
    s = summarize_counterfactual(rows)
    for summary in (s, s["played"]):
        for key, vs in summary["against_imagined"].items():
            assert vs["all"]["mean_abs_delta_p"] == 0.0 and vs["all"]["decision_flips"] == 0, key
        assert {f["p_auc_wrong"] for f in summary["futures"].values()} == {0.5}


async def test_the_policys_own_played_states_are_probed_too(valid_seen, alfworld_data):
    """The play executes the scripted drafts: replaying them on the same game gives, state by state,
    the expert action, label and real answer each played row was reflected on with."""
    replayed = []

    async def replay(env, branch, game, ctx, llm):
        ep = Episode(ctx, game, "replay", await env.reset(game))
        plan = await env.walkthrough()
        for t, draft in enumerate(llm.played):
            s, expert, prefix = ep.state(), expert_plan_action(ep, plan), list(ep.actions)
            ep.advance(draft, await env.step(draft))
            expert_real = None
            if expert is not None:
                await branch.restore(game, prefix)
                expert_real = (await branch.step(expert)).observation
            replayed.append((t, draft, expert, s, ep.current.observation, expert_real))

    rows, llm = await probe(valid_seen, alfworld_data, reads=True, replay=replay)
    played = [r for r in rows if r.kind == "played"]
    # as many steps as the walkthrough has (the scripted play does not win so soon), one row a step
    assert len(llm.played) == len(llm.plan) and [r.t for r in played] == list(range(len(llm.plan)))
    assert [r.draft for r in played] == llm.played
    for r, (t, draft, expert, s, real, expert_real) in zip(played, replayed, strict=True):
        assert (r.t, r.draft, r.expert) == (t, draft, expert)
        assert r.draft_match == (canonical_action(draft) == canonical_action(expert))
        shown = llm.shown_played[s]  # imagined, real, contradicting where known, none
        assert shown[0] == "You imagine it works." and shown[1] == real and shown[-1] is None
        assert r.draft_fails == (real.strip() == "Nothing happens.") == (draft == BAD)
        if r.draft_fails:  # contradicted by the expert action's real answer, taken at the played state
            assert shown == ["You imagine it works.", real, expert_real, None]
            assert (r.p["real"], r.p["contradicting"]) == (0.9, 0.1)
        else:  # contradicted by the failure answer
            assert len(shown) == 4 and shown[2].strip() == "Nothing happens."
            assert (r.p["real"], r.p["contradicting"]) == (0.1, 0.9)
    kinds = {(r.draft_match, r.draft_fails) for r in played}
    assert {(True, False), (False, False), (False, True)} <= kinds  # right, wrong that works, failing
    assert played[0].draft_match and played[0].expert == llm.plan[0]
    # still on the walkthrough after its first action: the walkthrough's next action is the label
    assert played[1].expert == llm.plan[1] and not played[1].draft_match

    s = summarize_counterfactual(rows)
    walk = walkthrough_rows(rows)
    assert {k: v for k, v in s.items() if k != "played"} == {
        k: v for k, v in summarize_counterfactual(walk).items() if k != "played"
    }
    assert summarize_counterfactual(walk)["played"] is None
    as_walkthrough = summarize_counterfactual([dataclasses.replace(r, kind="walkthrough") for r in played])
    assert s["played"] == {k: v for k, v in as_walkthrough.items() if k != "played"}
    assert s["played"]["failing_drafts"] == llm.played.count(BAD) and s["states"] == len(walk)
    lines = counterfactual_lines(s)
    assert lines[: len(counterfactual_lines({**s, "played": None}))] == counterfactual_lines({**s, "played": None})
    assert lines[7].startswith("counterfactual, the policy's played states:")
