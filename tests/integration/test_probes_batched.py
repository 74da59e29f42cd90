"""``evaluator.probes.PROBE_STATES``: the probes step each walkthrough first, then send the states' model calls
together. On real valid_seen games with the tiny model on a real embedded server, the rows are
those of the state-by-state path (``PROBE_STATES = 0``), and the calls of several states of one
game were in flight at once."""

from __future__ import annotations

import asyncio

import pytest

from tests.fixtures.alfworld import valid_seen_config

pytestmark = pytest.mark.alfworld


def probe(monkeypatch, server, alfworld_data, tiny_model_dir, tmp_path, probe_states: int) -> tuple[list, int]:
    """The probe rows of two spread valid_seen games, one game at a time, and the most drafts in flight."""
    from actors.llm import AgentLLM
    from comap_async.envs import games_from_config
    from comap_async.envs.base import spread_sample
    from comap_async.logsetup import configure_logging
    from comap_async.wire.messages import Registry
    from evaluator import probes
    from evaluator.probes import run_probes

    monkeypatch.setattr(probes, "PROBE_STATES", probe_states)
    cfg = valid_seen_config(server, alfworld_data, tiny_model_dir, tmp_path, "actor.envs=1")
    games = spread_sample(games_from_config(cfg, "valid_seen"), 2, cfg.run.seed)
    in_flight, most = [0], [0]
    draft = AgentLLM.draft_scored

    async def counted(self, s, **kw):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            return await draft(self, s, **kw)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(AgentLLM, "draft_scored", counted)
    out = asyncio.run(asyncio.wait_for(run_probes(cfg, games, Registry.serving(0), configure_logging("probe")), 300))
    assert out["failed_games"] == []
    return out["rows"], most[0]


def test_states_probed_together_give_the_rows_of_the_state_by_state_path(
    monkeypatch, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    one_by_one, most_before = probe(monkeypatch, roomy_server, alfworld_data, tiny_model_dir, tmp_path, 0)
    together, most = probe(monkeypatch, roomy_server, alfworld_data, tiny_model_dir, tmp_path, 8)
    assert most_before == 1 and most > 1  # one game at a time: only the batched path overlaps its states
    assert len(together) == len(one_by_one) > 4
    assert {r["kind"] for r in together} == {"walkthrough", "failure"}
    for a, b in zip(one_by_one, together):
        p_a, p_b = a.pop("p_revise"), b.pop("p_revise")
        assert a == b
        assert (p_a is None) == (p_b is None) and (p_a is None or abs(p_a - p_b) < 1e-4)
