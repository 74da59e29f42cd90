"""``experiments/studies/expert_path.py``'s walk of the handcoded expert on real held-out ALFWorld games."""

from __future__ import annotations

import pytest

from experiments.studies.expert_path import DELIVERING, PASSING, expert_states
from learner.batches import carrying_after

pytestmark = pytest.mark.alfworld


def test_the_walk_wins_and_marks_deliveries_by_the_learners_rule(valid_seen):
    walked = [expert_states(game, 50) for game in valid_seen[:4]]
    # the handcoded expert is not perfect (one of these four runs out of steps), but it never stops early
    assert all(won or len(states) == 50 for states, won in walked) and sum(won for _, won in walked) >= 3
    deliveries = 0
    for states, _ in walked:
        carrying = False
        for before, after in zip(states, states[1:]):
            # the observation the expert's action got is the next state's last turn
            assert after.conversation.turns[-1][0] == before.expert
            carrying = carrying_after(carrying, before.expert, after.conversation.turns[-1][1])
            assert after.delivering == (carrying and after.expert.startswith("go "))
            deliveries += after.delivering
        took = [i for i, st in enumerate(states) if st.expert.startswith("take ")]
        for st in states[: took[0] + 1] if took else states:
            assert not st.delivering  # nothing is carried before the first take
    assert deliveries > 0
    passing = [st for states, _ in walked for st in states if st.passing]
    assert passing and all(not st.expert.startswith("take ") for st in passing)
    assert all(any(a.startswith("take ") for a in st.admissible) for st in passing)


def test_asked_states_follow_the_verbs(valid_seen):
    states, _ = expert_states(valid_seen[0], 50)
    assert all(st.asked(None) for st in states)
    assert [st for st in states if st.asked(frozenset({DELIVERING}))] == [st for st in states if st.delivering]
    assert [st for st in states if st.asked(frozenset({PASSING}))] == [st for st in states if st.passing]
    assert [st.expert for st in states if st.asked(frozenset({"take"}))] == [
        st.expert for st in states if st.expert.startswith("take ")
    ]
