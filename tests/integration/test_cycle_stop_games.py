"""``eval.cycle_stop`` on real valid_seen games with the tiny model on a real embedded server: the
greedy episodes that recur are ended early, their figures are those of the episodes played to the
end (measured in the same test with ``play_games(cycle_check=True)``, ``comap eval --cycle-check``), and
fewer environment steps run."""

from __future__ import annotations

import pytest

from tests.fixtures.alfworld import play_valid_seen

pytestmark = pytest.mark.alfworld
MAX_STEPS = 12
NO_HISTORY = "env.history_k=0"
"""The state is then the task, the observation and the commands: a repeated "Nothing happens."
recurs at once, as a trained policy's take/move loop does over a longer cycle."""


def play(method: str, server, alfworld_data, tiny_model_dir, tmp_path, *extra: str, check: bool = False):
    """The two games' statistics and the environment steps actually taken (``check``: every game played to
    its end, the stop's projection compared)."""
    env_steps = [0]

    def on_step() -> None:
        env_steps[0] += 1

    stats = play_valid_seen(
        method,
        server,
        alfworld_data,
        tiny_model_dir,
        tmp_path,
        MAX_STEPS,
        "eval.temperature=0",
        NO_HISTORY,
        *extra,
        on_step=on_step,
        cycle_check=check,
    )
    return stats, env_steps[0]


def figures(s) -> tuple:
    return (s.won, s.steps, s.loops, s.invalid, s.revisions, s.parse_problems, s.gate_reasons, s.delta_f1)


@pytest.mark.parametrize("method", ["draft_only", "comap"])
def test_recurring_games_end_early_with_the_figures_of_the_whole_game(
    method, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    checked, played_all = play(
        method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, "eval.cycle_stop=2", check=True
    )
    recurred = [s for s in checked if s.cycle_check is not None]
    assert recurred, "with no history, the tiny model's invalid commands should revisit a state"
    assert all(s.cycle_check["exact"] for s in recurred), [s.cycle_check for s in recurred]
    assert played_all == sum(s.steps for s in checked)  # check mode plays every step

    stopped, played = play(method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, "eval.cycle_stop=2")
    assert [figures(s) for s in stopped] == [figures(s) for s in checked]
    assert played == played_all - sum(s.cycle_projected for s in stopped) < played_all


def test_the_turns_form_ends_a_cycle_played_through_twice(roomy_server, alfworld_data, tiny_model_dir, tmp_path):
    """The turns form: the draft sees the whole history, so the stop is a measured premise;
    the stopped games end where the played-through ones' projections were made, with their figures
    wherever the check found the projection exact, and fewer environment steps run."""
    turns = ("env.prompt_form=draft_turns", "eval.cycle_stop=3")
    checked, played_all = play("comap", roomy_server, alfworld_data, tiny_model_dir, tmp_path, *turns, check=True)
    recurred = [s for s in checked if s.cycle_check is not None]
    assert recurred, "with no history, the tiny model's invalid commands should repeat a cycle"
    stopped, played = play("comap", roomy_server, alfworld_data, tiny_model_dir, tmp_path, *turns)
    for whole, cut in zip(checked, stopped):
        if whole.cycle_check is None:
            assert cut.cycle_projected == 0 and figures(cut) == figures(whole)
            continue
        assert cut.steps - cut.cycle_projected == whole.cycle_check["at"]
        if whole.cycle_check["exact"]:
            assert figures(cut) == figures(whole)
    assert played == played_all - sum(s.cycle_projected for s in stopped) < played_all
