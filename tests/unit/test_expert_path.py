"""``experiments/studies/expert_path.py``'s pure parts: which states are asked and how they are summed up."""

from __future__ import annotations

import math

import pytest

from experiments.studies.expert_path import FINISHING, is_passing, summary, verbs_of
from experiments.studies.take_chances import Chances, is_chance, task_object


def test_verbs_select_the_states_asked():
    assert verbs_of("all") is None
    assert verbs_of("finishing") == frozenset(FINISHING)
    assert verbs_of("take, move,") == {"take", "move"}
    assert verbs_of("finishing,passing") == {*FINISHING, "passing"}
    assert is_passing("go to desk 2", ["go to desk 2", "take book 1 from desk 1"])
    assert not is_passing("take pen 1 from desk 1", ["take pen 1 from desk 1", "take book 1 from desk 1"])
    assert not is_passing("go to desk 2", ["go to desk 2", "open drawer 1"])


def test_summary_per_word_finishing_and_all():
    def row(expert, draft, p, p_draft=0.3):
        lp = {"expert_logprob": math.log(p), "draft_logprob": math.log(p if draft == expert else p_draft)}
        return {"model": "m", "expert": expert, "draft": draft, **lp}

    rows = [
        row("take pen 1 from desk 1", "take pen 1 from desk 1", 0.8),
        row("take pen 1 from desk 1", "go to desk 2", 0.2),
        row("move pen 1 to shelf 1", "close shelf 1", 0.4),
        row("go to desk 1", "go to desk 1", 0.5),
    ]
    by = summary(rows)["m"]
    assert by["take"] == {
        "states": 2, "draft_is_expert": 0.5, "p_expert": 0.5, "expert_likelier": 0.0, "draft_takes": 0.5
    }  # fmt: skip
    assert by["finishing"]["states"] == 3 and math.isclose(by["finishing"]["draft_is_expert"], 1 / 3)
    assert by["all"]["states"] == 4 and by["all"]["draft_is_expert"] == 0.5
    assert by["move"]["expert_likelier"] == 1.0  # 0.4 against the draft's 0.3: a whole-command decode wins it
    assert by["go"]["states"] == 1 and list(by)[0] == "all"  # largest group first


def test_passing_states_count_the_drafts_that_take_an_object_the_expert_leaves():
    rows = [
        {"model": "m", "expert": "go to desk 2", "draft": d, "passing": True, "expert_logprob": -1.0,
         "draft_logprob": -0.5}
        for d in ("take book 1 from desk 1", "go to desk 2", "take pen 2 from desk 1", "open drawer 1")
    ]  # fmt: skip
    by = summary(rows)["m"]
    assert by["passing"]["states"] == 4 and by["passing"]["draft_takes"] == 0.5
    assert by["go"]["draft_is_expert"] == 0.25
    carrying = [{**rows[1], "passing": False, "delivering": True}, {**rows[0], "passing": False, "delivering": True}]
    assert summary(carrying)["m"]["delivering"] == {
        "states": 2, "draft_is_expert": 0.5, "p_expert": math.exp(-1.0), "expert_likelier": 0.0, "draft_takes": 0.5
    }  # fmt: skip


def test_take_chances_read_the_task_object_from_the_game_name():
    name = "valid_seen/pick_and_place_simple-SprayBottle-None-GarbageCan-409/trial_T20190909_044715_250790"
    assert task_object(name) == "spraybottle"
    with pytest.raises(ValueError, match="not an ALFWorld game name"):
        task_object("games/foo/trial")
    admissible = ["go to cabinet 2", "take spraybottle 2 from cabinet 1", "take soapbar 1 from cabinet 1"]
    assert is_chance(admissible, "spraybottle") == ["take spraybottle 2 from cabinet 1"]
    assert is_chance(admissible, "spray") == []  # a type, not a prefix of one
    total = Chances()
    for states, taken in [(3, 0), (0, 0), (2, 1)]:
        total.add(states, taken)
    assert (total.states, total.taken, total.games, total.games_taken) == (5, 1, 2, 1)
