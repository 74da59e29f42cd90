"""The loop rate on hand-made step lists, and an evaluator version whose success games crashed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.episodes import EpisodeStats
from comap_async.diagnostics import loop_steps
from evaluator.eval_report import summarize

AT_DESK = frozenset({"at(desk 1)"})
HOLDING = frozenset({"at(desk 1)", "holding(bowl 1)"})


def test_no_repeat_no_loop():
    assert (
        loop_steps([(frozenset(), "go to desk 1"), (AT_DESK, "take bowl 1 from desk 1"), (HOLDING, "go to shelf 1")])
        == 0
    )


def test_a_take_move_cycle_counts_from_its_second_turn():
    cycle = [(AT_DESK, "take bowl 1 from desk 1"), (HOLDING, "move bowl 1 to desk 1")]
    assert loop_steps(cycle) == 0
    assert loop_steps(cycle * 3) == 4  # turns 2 and 3: every step comes back to a (state, action) seen


def test_an_action_repeated_where_it_changes_nothing_loops_and_another_action_does_not():
    assert loop_steps([(AT_DESK, "look")] * 49) == 48
    assert loop_steps([(AT_DESK, "look"), (AT_DESK, "inventory"), (AT_DESK, "examine desk 1")]) == 0
    # the same action from another state is not a repeat
    assert loop_steps([(AT_DESK, "go to shelf 1"), (HOLDING, "go to shelf 1")]) == 0


def test_the_episode_and_report_carry_the_loop_rate():
    stats = EpisodeStats(steps=6, state_actions=[(AT_DESK, "look")] * 4 + [(HOLDING, "look"), (AT_DESK, "go")])
    assert stats.loops == 3 and stats.metrics()["loop_rate"] == pytest.approx(0.5)
    game = SimpleNamespace(name="g", task_type="t")
    report = summarize([(game, stats), (game, EpisodeStats(steps=4, state_actions=[(AT_DESK, "a")] * 4))], "s", 1, 0.0)
    assert report["loop_rate"] == pytest.approx((3 + 3) / 10) and [e["loops"] for e in report["episodes"]] == [3, 3]


class AdapterClient:
    """The evaluator's own client: it only loads and unloads the version's adapters."""

    async def load_adapter(self, *a, **k):
        pass

    async def unload_adapter(self, *a, **k):
        pass


def one_game_evaluator(monkeypatch, cfg, log, probes, games_played):
    """An evaluator of one probe game and one success game, its probes and games replaced."""
    import evaluator.eval_runner
    import evaluator.probes
    from evaluator.evaluator import Evaluator

    monkeypatch.setattr(evaluator.probes, "run_probes", probes)
    monkeypatch.setattr(evaluator.eval_runner, "play_games", games_played)
    ev = Evaluator(cfg, log)
    ev.__dict__["games"] = ([SimpleNamespace(name="g")], [SimpleNamespace(name="g")])
    return ev


async def test_an_evaluated_version_whose_success_game_crashed_has_no_success_rate(monkeypatch, tmp_path):
    from comap_async.config import load_config

    async def probes(*args, **kwargs):
        return {"wm_delta_f1": 0.5}

    async def games_played(cfg, games, *args, **kwargs):
        return []  # the one game's episode failed (logged as actor.episode_failed): no result for it

    errors = []
    log = SimpleNamespace(error=lambda event, **kw: errors.append((event, kw)), info=lambda *a, **k: None)
    cfg = load_config(None, [f"run.root={tmp_path}", "eval.success_games=1"])
    result = await one_game_evaluator(monkeypatch, cfg, log, probes, games_played).evaluate(
        AdapterClient(), 3, {"phase": "coevolve"}
    )
    assert "success_rate" not in result and "1 of 1 episodes failed" in result["success_error"]
    assert result["wm_delta_f1"] == 0.5 and errors[0][0] == "evaluator.incomplete"


async def test_the_evaluators_probes_and_games_call_at_its_priority(monkeypatch, tmp_path):
    """``eval.priority`` reaches its probes and success games, which open their clients with it; the
    config keeps no priority (the actors' calls carry none)."""
    from comap_async.config import load_config

    seen = []

    async def probes(cfg, *args, **kwargs):
        seen.append(("probes", kwargs["priority"], cfg.actor.envs))
        return {"wm_delta_f1": 0.5}

    async def games_played(cfg, games, *args, **kwargs):
        seen.append(("games", kwargs["priority"], cfg.actor.envs))
        return []

    log = SimpleNamespace(error=lambda *a, **kw: None, info=lambda *a, **k: None)
    cfg = load_config(None, [f"run.root={tmp_path}", "eval.success_games=1", "eval.priority=-1", "eval.envs=3"])
    await one_game_evaluator(monkeypatch, cfg, log, probes, games_played).evaluate(
        AdapterClient(), 3, {"phase": "coevolve"}
    )
    assert seen == [("probes", -1, 3), ("games", -1, 3)]


def test_an_evaluation_that_played_a_game_twice_and_another_never_is_incomplete():
    """Each game exactly once: four results for four games are not enough when one game was played
    twice (the per-loop stride of an older worker did that when loops finished at different times)."""
    from evaluator.eval_runner import EvalIncomplete, check_complete

    games = [SimpleNamespace(name=f"g{i}") for i in range(4)]
    stats = EpisodeStats()
    check_complete([(g, stats) for g in reversed(games)], games)  # any order, each once: complete
    with pytest.raises(EvalIncomplete, match="each game once"):
        check_complete([(games[0], stats), (games[1], stats), (games[2], stats), (games[0], stats)], games)
    with pytest.raises(EvalIncomplete, match="1 of 4 episodes failed"):
        check_complete([(g, stats) for g in games[:3]], games)


async def test_a_failing_probe_stops_the_games_beside_it_and_is_raised_as_it_was(monkeypatch, tmp_path):
    """With the probes beside the games, a probe's error ends the evaluation as that error (not wrapped),
    the games still running are cancelled, and the version's adapters are unloaded."""
    import asyncio

    from comap_async.config import load_config

    games_cancelled = asyncio.Event()

    async def probes(*args, **kwargs):
        await asyncio.sleep(0)
        raise ConnectionError("server gone")

    async def games_played(*args, **kwargs):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            games_cancelled.set()
            raise

    unloaded = []

    class Client(AdapterClient):
        async def unload_adapter(self, name, **k):
            unloaded.append(name)

    log = SimpleNamespace(error=lambda *a, **kw: None, info=lambda *a, **k: None)
    cfg = load_config(None, [f"run.root={tmp_path}", "eval.success_games=1"])
    with pytest.raises(ConnectionError, match="server gone"):
        await one_game_evaluator(monkeypatch, cfg, log, probes, games_played).evaluate(Client(), 3, {})
    assert games_cancelled.is_set() and len(unloaded) == 3
