"""``experiments/studies/take_chances.py`` on real held-out ALFWorld games: the expert's own actions replayed."""

from __future__ import annotations

import pytest

from experiments.studies.expert_path import expert_states
from experiments.studies.take_chances import replay, task_object

pytestmark = pytest.mark.alfworld


def test_the_expert_takes_its_chance_and_a_walker_past_it_does_not(valid_seen):
    game = next(g for g in valid_seen if task_object(g.name) == "alarmclock")
    states, won = expert_states(game, 50)
    expert = [st.expert for st in states]
    assert won and any(a.startswith("take alarmclock ") for a in expert)
    chances, taken = replay(game, expert, 50)
    assert chances >= 1 and taken == 1  # the expert stands by the alarm clock once and takes it
    # the same walk without the take: at the same place, the chance is there and not taken
    passing = [a for a in expert if not a.startswith("take ")]
    chances_passing, taken_passing = replay(game, passing, 50)
    assert chances_passing >= 1 and taken_passing == 0
