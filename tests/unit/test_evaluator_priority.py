"""The evaluator's request priorities: beside the success games the probes go one priority behind them,
so the longest game's calls are admitted first; in turn, both go at ``eval.priority``."""

from __future__ import annotations

import pytest
import structlog

from actors.evaluator import Evaluator
from comap_async.config import load_config
from comap_async.config.base import PRIORITY_MAX


@pytest.mark.parametrize(
    ("sets", "games", "probes"),
    [
        ([], 0, 1),
        (["eval.priority=-1"], -1, 0),
        (["eval.priority=-1", "eval.probes_beside_games=false"], -1, -1),
        ([f"eval.priority={PRIORITY_MAX}"], PRIORITY_MAX, PRIORITY_MAX),
    ],
)
def test_the_probes_yield_to_the_games_beside_them(sets, games, probes):
    evaluator = Evaluator(load_config(None, sets), structlog.get_logger())
    assert evaluator.playing_config.inference.request_priority == games
    assert evaluator.probing_config.inference.request_priority == probes
    assert evaluator.probing_config.actor.envs == evaluator.playing_config.actor.envs
