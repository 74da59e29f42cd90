"""The ALFWorld fact parser on real observation strings, one test per template family."""

from __future__ import annotations

import sys
import time

import pytest

from comap_async.envs import get_fact_parser
from comap_async.envs.alfworld_facts import parse_facts
from comap_async.facts import NO_CHANGE, delta_f1, fact_changes

CASES = [
    (
        "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. "
        "Looking quickly around you, you see a bed 1, "
        "a desk 1, a drawer 2, a drawer 1, a garbagecan 1, a shelf 1, and a sidetable 1.\n\n"
        "Your task is to: examine the bowl with the desklamp.",
        {"at(room)"},
    ),
    ("You are in the middle of a room. Looking quickly around you, you see nothing.", {"at(room)"}),
    (
        "You arrive at desk 1. On the desk 1, you see a alarmclock 2, a book 1, a mug 1, a pen 2, and a pen 1.",
        {
            "at(desk 1)",
            "in(alarmclock 2, desk 1)",
            "in(book 1, desk 1)",
            "in(mug 1, desk 1)",
            "in(pen 2, desk 1)",
            "in(pen 1, desk 1)",
        },
    ),
    (
        "On the sidetable 2, you see a alarmclock 1, and a cd 1.",
        {"at(sidetable 2)", "in(alarmclock 1, sidetable 2)", "in(cd 1, sidetable 2)"},
    ),
    ("On the bed 1, you see a pillow 2.", {"at(bed 1)", "in(pillow 2, bed 1)"}),
    ("On the shelf 4, you see nothing.", {"at(shelf 4)", "empty(shelf 4)"}),
    ("You arrive at safe 1. The safe 1 is closed.", {"at(safe 1)", "closed(safe 1)"}),
    ("The drawer 8 is closed.", {"at(drawer 8)", "closed(drawer 8)"}),
    (
        "You arrive at drawer 2. The drawer 2 is open. In it, you see a spraybottle 2, and a toiletpaper 2.",
        {"at(drawer 2)", "open(drawer 2)", "in(spraybottle 2, drawer 2)", "in(toiletpaper 2, drawer 2)"},
    ),
    (
        "You open the drawer 3. The drawer 3 is open. In it, you see nothing.",
        {"at(drawer 3)", "open(drawer 3)", "empty(drawer 3)"},
    ),
    ("You close the drawer 2.", {"at(drawer 2)", "closed(drawer 2)"}),
    ("You pick up the alarmclock 2 from the desk 1.", {"holding(alarmclock 2)", "at(desk 1)"}),
    ("You move the book 1 to the sofa 1.", {"in(book 1, sofa 1)", "at(sofa 1)"}),
    ("You are carrying: a cellphone 1.", {"holding(cellphone 1)"}),
    ("You are not carrying anything.", {"holding(nothing)"}),
    ("You are facing the drawer 7, and drawer 6. Next to it, you see nothing.", {"at(drawer 7)", "at(drawer 6)"}),
    ("You turn on the desklamp 1.", {"on(desklamp 1)"}),
    ("You heat the apple 1 using the microwave 1.", {"hot(apple 1)", "holding(apple 1)", "at(microwave 1)"}),
    ("You cool the apple 1 using the fridge 1.", {"cool(apple 1)", "holding(apple 1)", "at(fridge 1)"}),
    (
        "You clean the butterknife 1 using the sinkbasin 1.",
        {"clean(butterknife 1)", "holding(butterknife 1)", "at(sinkbasin 1)"},
    ),
    ("This is a normal mug 2. In it, you see nothing.", {"empty(mug 2)"}),
    ("There's nothing special about teddybear 1.", {"plain(teddybear 1)"}),
    # grammar templates of examineObject (alfred.twl2) that the sampled runs did not reach
    ("This is a hot and clean sliced apple 1.", {"hot(apple 1)", "clean(apple 1)", "sliced(apple 1)"}),
    ("This is a cold tomato 1.", {"cool(tomato 1)"}),
    ("This desklamp 1 is on.", {"on(desklamp 1)"}),
    ("Nothing happens.", {NO_CHANGE}),
]


@pytest.mark.parametrize("text,expected", CASES, ids=[c[0][:40] for c in CASES])
def test_template_families(text, expected):
    assert parse_facts(text) == frozenset(expected)


def test_help_text_is_no_change():
    help_text = (
        "Available commands:\n  look:                             look around your current location\n"
        "  inventory:                        check your current inventory\n"
    )
    assert parse_facts(help_text) == frozenset({NO_CHANGE})


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "You arrive at the kitchen.",
        "The apple is red.",
        "You pick up the apple 1.",
        "Nothing happens. You arrive at desk 1.",
        "You arrive at desk 1. On the desk 1, you see a mug 1 and some garbage.",
    ],
)
def test_unreadable_text_is_none(text):
    assert parse_facts(text) is None


def test_nothing_happens_induces_no_change():
    before = parse_facts("You arrive at desk 1. On the desk 1, you see a mug 1.")
    assert fact_changes(before, parse_facts("Nothing happens.")) == frozenset()
    real = parse_facts("Nothing happens.")
    assert delta_f1(before, parse_facts("Nothing happens."), real) == 1.0
    assert delta_f1(before, parse_facts("You pick up the mug 1 from the desk 1."), real) == 0.0


def test_wrong_prediction_scores_below_right_one():
    prev = parse_facts("You arrive at fridge 1. The fridge 1 is closed.")
    real = parse_facts("You open the fridge 1. The fridge 1 is open. In it, you see a apple 1, and a egg 2.")
    wrong = parse_facts("You open the fridge 1. The fridge 1 is open. In it, you see nothing.")
    assert delta_f1(prev, real, real) == 1.0
    assert 0.0 < delta_f1(prev, wrong, real) < 1.0
    assert delta_f1(prev, None, real) == 0.0


def test_parser_is_pure_and_fast():
    assert get_fact_parser("alfworld") is parse_facts
    text = CASES[2][0]
    t0 = time.perf_counter()
    for _ in range(2000):
        parse_facts(text)
    assert (time.perf_counter() - t0) / 2000 < 200e-6


def test_parser_module_imports_no_engine():
    import subprocess

    code = (
        "import sys, comap_async.envs.alfworld_facts; "
        "print([m for m in ('alfworld','textworld','torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# ---- is_readable: the broker's shortcut must agree with parse_facts on every text ----------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from comap_async.envs.alfworld_facts import is_readable  # noqa: E402

_PIECES = [c[0] for c in CASES] + [
    "Your task is to: put a clean apple in fridge.",
    "-= Welcome to TextWorld, ALFRED! =-",
    "You don't see any switch on the fridge 1.",
    "Available commands:\n  look: look around\n",
    "PickupObjectFromReceptacleObject: You pick up the mug 1.",
    "You sliced the apple 1 with the knife 2.",
    "You are in the middle of a room.",
    "On the desk 1, you see a mug 1 and",
    "garbage",
    "You arrive at",
    " ",
    "\n",
    "\n\n",
    ".",
    ", and a cd 1.",
    "a mug 1",
    "Nothing happens.",
]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=0, max_size=5), st.sampled_from(["", " ", "\n", "  "]))
def test_is_readable_agrees_with_parse_facts(pieces, sep):
    text = sep.join(pieces)
    assert is_readable(text) == (parse_facts(text) is not None), text


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet="You arrive at desk 1.On the ,seamug2Nothing happens\n", max_size=60))
def test_is_readable_agrees_on_near_miss_text(text):
    assert is_readable(text) == (parse_facts(text) is not None), text


@pytest.mark.parametrize("text,expected", CASES, ids=[c[0][:40] for c in CASES])
def test_is_readable_on_every_template(text, expected):
    assert is_readable(text)
