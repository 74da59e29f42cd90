"""``env.tasks`` picks ALFWorld's games by task name, as it picks ScienceWorld's: the real valid_seen games."""

from __future__ import annotations

import pytest

from comap_async.config import load_config
from comap_async.envs.alfworld_games import TASK_TYPES, games_for_config
from comap_async.errors import CommandError


def test_env_tasks_names_alfworld_task_types(alfworld_data):
    every = games_for_config(load_config(None, [f"env.data_dir={alfworld_data}"]), "valid_seen")
    chosen = games_for_config(
        load_config(None, [f"env.data_dir={alfworld_data}", "env.tasks=[look_at_obj_in_light,pick_two_obj_and_place]"]),
        "valid_seen",
    )
    assert len(every) == 140
    assert 0 < len(chosen) < len(every)
    assert {g.task_type for g in chosen} == {2, 6}
    assert {TASK_TYPES[g.task_type] for g in chosen} == {"look_at_obj_in_light", "pick_two_obj_and_place"}
    assert {g.name for g in chosen} == {g.name for g in every if g.task_type in (2, 6)}


def test_an_unknown_alfworld_task_is_one_line_naming_the_known_ones(alfworld_data):
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.tasks=[pick_and_place]"])
    with pytest.raises(CommandError, match="unknown ALFWorld task pick_and_place .known: pick_and_place_simple,"):
        games_for_config(cfg, "valid_seen")
