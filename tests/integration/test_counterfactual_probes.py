"""Counterfactual probes on a real ALFWorld game, with scripted models (the model is the only stand-in):
each walkthrough state's draft is reflected on under four futures, and the figures tell a reflection
that reads the future it is shown from one that ignores it."""

from __future__ import annotations

import pytest

from actors.episodes import EpisodeContext
from actors.llm import Draft, Reflected
from comap_async.config import load_config
from comap_async.envs.alfworld_facts import next_state
from comap_async.envs.pool import AsyncEnvPool
from comap_async.wire.messages import Registry
from evaluator.counterfactual import counterfactual_game, summarize_counterfactual

pytestmark = pytest.mark.alfworld

BAD = "take nothing 9 from nowhere 9"  # a command the game cannot carry out: "Nothing happens."


class Scripted:
    """Drafts the expert's action, then ``look``, then an impossible command, in turn; reflects with
    a revision toward the expert's action. ``reads``: ``p`` follows the future shown (0.9 after a
    failure answer, 0.1 after anything else, 0.5 with none); otherwise ``p`` is 0.3 whatever it is."""

    def __init__(self, plan: list[str], reads: bool) -> None:
        self.plan, self.reads, self.t, self.shown = plan, reads, -1, []

    async def draft_scored(self, state, admissible=None):
        self.t += 1
        return Draft((self.plan[self.t], "look", BAD)[self.t % 3], None)

    async def imagine(self, state, action, conversation=None):
        return "You imagine it works."

    async def reflect(self, state, a_draft, s_hat, confidence=None, admissible=None, conversation=None, **kw):
        self.shown.append(s_hat)
        if not self.reads:
            p = 0.3
        elif s_hat is None:
            p = 0.5
        else:
            p = 0.9 if s_hat.strip() == "Nothing happens." else 0.1
        return Reflected("REVISE" if p > 0.5 else "KEEP", self.plan[self.t], p, 0.9, None)


async def probe(valid_seen, alfworld_data, reads: bool):
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
    return rows, llm


async def test_a_reflection_that_reads_the_future_moves_p_between_the_futures(valid_seen, alfworld_data):
    rows, llm = await probe(valid_seen, alfworld_data, reads=True)
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
    for key, vs in s["against_imagined"].items():
        assert vs["all"]["mean_abs_delta_p"] == 0.0 and vs["all"]["decision_flips"] == 0, key
    assert {f["p_auc_wrong"] for f in s["futures"].values()} == {0.5}
