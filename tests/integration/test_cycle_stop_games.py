"""``eval.cycle_stop`` on real valid_seen games with the tiny model on a real embedded server: the
greedy episodes that recur are ended early, their figures are those of the episodes played to the
end (measured in the same test with ``eval.cycle_stop_check``), and fewer environment steps run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.eval_runner import play_games
from comap_async.config import load_config
from comap_async.envs import games_from_config
from comap_async.envs.base import spread_sample
from comap_async.logsetup import configure_logging
from comap_async.wire.messages import Registry

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 12


def play(method: str, server, alfworld_data, tiny_model_dir, tmp_path, *extra: str):
    cfg = load_config(
        REPO / "configs" / "test.yaml",
        [
            f"run.root={tmp_path}",
            f"model.name_or_path={tiny_model_dir}",
            f"inference.endpoints=['{server.url}']",
            f"env.data_dir={alfworld_data}",
            "env.split=valid_seen",
            f"env.max_steps={MAX_STEPS}",
            "eval.temperature=0",
            "env.history_k=0",  # the state is then the task, the observation and the commands: a repeated
            # "Nothing happens." recurs at once, as a trained policy's take/move loop does over a longer cycle
            *extra,
        ],
    )
    games = spread_sample(games_from_config(cfg, "valid_seen"), 2, cfg.run.seed)
    env_steps = [0]

    def on_step() -> None:
        env_steps[0] += 1

    results = asyncio.run(
        asyncio.wait_for(
            play_games(
                cfg, games, Registry.serving(0), configure_logging("cycle-test"), envs=1, method=method, on_step=on_step
            ),
            300,
        )
    )
    by_game = {g.name: s for g, s in results}
    return [by_game[g.name] for g in games], env_steps[0]


def figures(s) -> tuple:
    return (s.won, s.steps, s.loops, s.invalid, s.revisions, s.parse_problems, s.gate_reasons, s.delta_f1)


@pytest.mark.parametrize("method", ["draft_only", "comap"])
def test_recurring_games_end_early_with_the_figures_of_the_whole_game(
    method, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    checked, played_all = play(
        method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, "eval.cycle_stop=2", "eval.cycle_stop_check=true"
    )
    recurred = [s for s in checked if s.cycle_check is not None]
    assert recurred, "with no history, the tiny model's invalid commands should revisit a state"
    assert all(s.cycle_check["exact"] for s in recurred), [s.cycle_check for s in recurred]
    assert played_all == sum(s.steps for s in checked)  # check mode plays every step

    stopped, played = play(method, roomy_server, alfworld_data, tiny_model_dir, tmp_path, "eval.cycle_stop=2")
    assert [figures(s) for s in stopped] == [figures(s) for s in checked]
    assert played == played_all - sum(s.cycle_projected for s in stopped) < played_all
