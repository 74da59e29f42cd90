"""ScienceWorld's canonical facts on real observations.

Every text below was returned by the scienceworld 1.2.3 simulator (gold runs and random valid
actions over dev and train variations, simplifications ``easy``); the expected facts are written
out by hand from what the text says.
"""

from __future__ import annotations

import pytest

from comap_async.envs import get_fact_parser, get_next_state
from comap_async.envs.scienceworld_facts import canonical, next_state, parse_facts
from comap_async.facts import NO_CHANGE, fact_changes, state_delta_f1

KITCHEN = (
    "This room is called the kitchen. In it, you see: \n\tthe agent\n\ta substance called air\n"
    "\ta chair. On the chair is: nothing.\n"
    "\ta counter. On the counter is: a bowl (containing a red apple, a banana, an orange, a potato), a drawer.\n"
    "\ta cupboard. The cupboard door is closed. \n\ta freezer. The freezer door is closed. \n"
    "\ta fridge. The fridge door is closed. \n\ta glass jar (containing a substance called sodium chloride)\n"
    "\ta lighter\n\ta oven, which is turned off. The oven door is closed. \n\ta painting\n"
    "\ta sink, which is turned off. In the sink is: nothing.\n\ta substance called soap\n"
    "\ta stopwatch, which is deactivated. \n\ta stove, which is turned off. On the stove is: nothing.\n"
    "\ta table. On the table is: a glass cup (containing nothing).\n"
    "\ta thermometer, currently reading a temperature of 10 degrees celsius\n"
    "You also see:\n\tA door to the bathroom (that is closed)\n\tA door to the hallway (that is open)\n"
    "\tA door to the outside (that is closed)"
)
KITCHEN_FACTS = {
    "at(kitchen)",
    "in(air, kitchen)",
    "in(chair, kitchen)",
    "empty(chair)",
    "in(counter, kitchen)",
    "in(bowl, counter)",
    "in(red apple, bowl)",
    "in(banana, bowl)",
    "in(orange, bowl)",
    "in(potato, bowl)",
    "in(drawer, counter)",
    "in(cupboard, kitchen)",
    "closed(cupboard)",
    "in(freezer, kitchen)",
    "closed(freezer)",
    "in(fridge, kitchen)",
    "closed(fridge)",
    "in(glass jar, kitchen)",
    "in(sodium chloride, glass jar)",
    "in(lighter, kitchen)",
    "in(oven, kitchen)",
    "off(oven)",
    "closed(oven)",
    "in(painting, kitchen)",
    "in(sink, kitchen)",
    "off(sink)",
    "empty(sink)",
    "in(soap, kitchen)",
    "in(stopwatch, kitchen)",
    "off(stopwatch)",
    "in(stove, kitchen)",
    "off(stove)",
    "empty(stove)",
    "in(table, kitchen)",
    "in(glass cup, table)",
    "empty(glass cup)",
    "in(thermometer, kitchen)",
    "reading(thermometer, 10 degrees celsius)",
    "closed(door to the bathroom)",
    "open(door to the hallway)",
    "closed(door to the outside)",
}

# (real observation, its facts), hand-checked
REAL = [
    (KITCHEN, KITCHEN_FACTS),
    (
        "This outside location is called the outside. Here you see: \n\tthe agent\n\ta substance called air\n\tan axe\n"
        "\ta fire pit (containing nothing)\n\ta fountain (containing nothing)\n"
        "\tthe ground\n\ta substance called wood\n"
        "You also see:\n\tA door to the foundry (that is open)\n\tA door to the greenhouse (that is open)\n"
        "\tA door to the kitchen (that is open)",
        {
            "at(outside)",
            "in(air, outside)",
            "in(axe, outside)",
            "in(fire pit, outside)",
            "empty(fire pit)",
            "in(fountain, outside)",
            "empty(fountain)",
            "in(ground, outside)",
            "in(wood, outside)",
            "open(door to the foundry)",
            "open(door to the greenhouse)",
            "open(door to the kitchen)",
        },
    ),
    (
        "This room is called the bedroom. In it, you see: \n\tthe agent\n\ta substance called air\n"
        "\ta bed. On the bed is: a mattress. On the mattress is: a white pillow..\n"
        "\ta book shelf (containing A book (Pride and Prejudice) titled Pride and Prejudice by Jane Austen)\n"
        "\ta closet. The closet door is closed. \n\ta finger painting\n\ta table. On the table is: nothing.\n"
        "You also see:\n\tA door to the hallway (that is open)",
        {
            "at(bedroom)",
            "in(air, bedroom)",
            "in(bed, bedroom)",
            "in(mattress, bed)",
            "in(white pillow, mattress)",
            "in(book shelf, bedroom)",
            "in(book (Pride and Prejudice) titled Pride and Prejudice by Jane Austen, book shelf)",
            "in(closet, bedroom)",
            "closed(closet)",
            "in(finger painting, bedroom)",
            "in(table, bedroom)",
            "empty(table)",
            "open(door to the hallway)",
        },
    ),
    (
        "In your inventory, you see:\n\tan orange\n"
        "\ta thermometer, currently reading a temperature of 10 degrees celsius",
        {"in(orange, inventory)", "in(thermometer, inventory)", "reading(thermometer, 10 degrees celsius)"},
    ),
    ("In your inventory, you see:\n\tnothing", {"empty(inventory)"}),
    ("Inside the sink is: \n\tnothing\n You also see: A drain, which is open.", {"empty(sink)", "open(drain)"}),
    (
        "a flower pot 2 (containing a pea plant in the reproducing stage with a tall height. On the pea plant you see: "
        "a purple flower. , soil)",
        {
            "in(pea plant in the reproducing stage with a tall height, flower pot 2)",
            "in(purple flower, pea plant in the reproducing stage with a tall height)",
            "in(soil, flower pot 2)",
        },
    ),
    ("a stopwatch, which is deactivated. The time reads 24 ticks.", {"off(stopwatch)", "reading(stopwatch, 24 ticks)"}),
    (
        "an inclined plane with a steel surface, with: a wood block approximately 6% down the plane",
        {"in(wood block approximately 6% down the plane, inclined plane with a steel surface)"},
    ),
    (
        "a switch, which is off. its anode is connected to: nothing. its cathode is connected to: nothing.",
        {"off(switch)"},
    ),
    ("You move to the kitchen.", {"at(kitchen)"}),
    ("You teleport to the art studio.", {"at(art studio)"}),
    ("You move through the door to the greenhouse.", {"at(greenhouse)"}),
    ("You move the thermometer to the inventory.", {"in(thermometer, inventory)"}),
    (
        "(disconnecting unknown substance P)You move the unknown substance P to the yellow box.",
        {"in(unknown substance P, yellow box)"},
    ),
    ("The cupboard is now open.", {"open(cupboard)"}),
    ("The stove is now activated.", {"on(stove)"}),
    ("The stopwatch is now deactivated.", {"off(stopwatch)"}),
    ("The door is already open.", {"open(door)"}),
    ("You focus on the water.", {"focus(water)"}),
    ("the thermometer measures a temperature of 73 degrees celsius", {"reading(thermometer, 73 degrees celsius)"}),
    (
        "anode on battery is now connected to terminal 1 on orange wire",
        {"connected(anode on battery, terminal 1 on orange wire)"},
    ),
    ("Yellow and red paint mix to produce orange paint.", {"made(orange paint)"}),
    ("Apples, oranges, and bananas mix to produce fruit salad.", {"made(fruit salad)"}),
    (
        "You dunk the wood cup in the wood cup, moving the liquids (yellow paint) to the wood cup.",
        {"in(yellow paint, wood cup)"},
    ),
    ("The stove appears broken, and can't be activated or deactivated.", {"broken(stove)"}),
    ("The drawer catches fire.", {"burning(drawer)"}),
    ("You hit the shovel with the axe, causing it to break.", {"broken(shovel)"}),
    ("You decide to wait for 10 iterations.", set()),
    (
        "Task description:\nYour task is to boil water. "
        "For compounds without a boiling point, combusting the substance "
        "is also acceptable. First, focus on the substance. Then, take actions that will cause it to change its state "
        "of matter.",
        set(),
    ),
    ("The recipe reads:\nTo make smores, you need to mix chocolate, marshmallow.", set()),
    ("No known action matches that input.", {NO_CHANGE}),
    (
        "Ambiguous request: Please enter the number for the action you intended (or blank to cancel):\n"
        "0:\tpick up air (in kitchen)\n1:\tpick up soap (in kitchen)",
        {NO_CHANGE},
    ),
    ("There is only one thing (orange)", {NO_CHANGE}),
    ("Mixing the contents of the kitchen does not appear to produce anything new.", {NO_CHANGE}),
]


@pytest.mark.parametrize("text,facts", REAL, ids=[t[:40] for t, _ in REAL])
def test_real_observations_parse_to_hand_checked_facts(text, facts):
    assert parse_facts(text) == frozenset(facts)


def test_glued_wire_descriptions_read_as_their_terminals():
    # the simulator writes "a black wireits terminal 1 ..." (no separator): still one wire, two terminals
    text = (
        "In your inventory, you see:\n\ta battery. its anode is connected to: nothing. its cathode is connected to: "
        "nothing. \n\ta black wireits terminal 1 is connected to: a terminal 2 on blue wire. its terminal 2 is "
        "connected to: nothing. \n\tan orange"
    )
    assert parse_facts(text) == {
        "in(battery, inventory)",
        "in(black wire, inventory)",
        "in(orange, inventory)",
        "connected(terminal 1 on black wire, terminal 2 on blue wire)",
    }


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "You pick up the apple 1 from the countertop 1.",
        "Nothing happens.",
        "The door is now ajar.",
        "This room is called the kitchen. In it, you see: ",
        "You move the thermometer.",
        "In your inventory, you see:\n\tan orange\nI think that is all.",
    ],
)
def test_unreadable_text_is_reported_as_such(text):
    assert parse_facts(text) is None and next_state(frozenset({"at(kitchen)"}), text) is None


def test_names_lose_articles_and_substance_called():
    assert canonical("a substance called sodium chloride") == "sodium chloride"
    assert canonical("an  orange") == "orange" and canonical("A door to the kitchen") == "door to the kitchen"


def test_next_state_keeps_what_is_not_mentioned_and_replaces_what_is():
    s = next_state(frozenset(), KITCHEN)
    assert s == KITCHEN_FACTS
    # picking the thermometer up moves it out of the kitchen; the rest of the kitchen stays known
    s2 = next_state(s, "You move the thermometer to the inventory.")
    assert fact_changes(s, s2) == {"+in(thermometer, inventory)", "-in(thermometer, kitchen)"}
    # walking away changes the location only
    s3 = next_state(s2, "You move to the hallway.")
    assert fact_changes(s2, s3) == {"+at(hallway)", "-at(kitchen)"}
    # open/closed and on/off exclude each other; one reading per instrument
    s4 = next_state(s3, "The fridge is now open.")
    assert fact_changes(s3, s4) == {"+open(fridge)", "-closed(fridge)"}
    s5 = next_state(s4, "the thermometer measures a temperature of 73 degrees celsius")
    assert fact_changes(s4, s5) == {
        "+reading(thermometer, 73 degrees celsius)",
        "-reading(thermometer, 10 degrees celsius)",
    }
    # a failed action and time passing leave the state as it was
    assert next_state(s5, "No known action matches that input.") == s5
    assert next_state(s5, "You decide to wait for 10 iterations.") == s5


def test_a_listing_replaces_the_remembered_contents_of_its_holder():
    s = next_state(frozenset(), KITCHEN)
    s2 = next_state(s, "a counter. On the counter is: a bowl (containing a banana), a drawer.")
    assert fact_changes(s, s2) == {"-in(red apple, bowl)", "-in(orange, bowl)", "-in(potato, bowl)"}
    s3 = next_state(s2, "Inside the bowl is: \n\tnothing")
    assert fact_changes(s2, s3) == {"-in(banana, bowl)", "+empty(bowl)"}


def test_pouring_moves_the_remembered_contents():
    s = frozenset({"in(water, jug)", "in(jug, sink)", "empty(flower pot 1)"})
    s2 = next_state(s, "You pour the contents of the jug into the flower pot 1.")
    assert s2 == {"in(water, flower pot 1)", "in(jug, sink)", "empty(jug)"}


def test_air_in_two_rooms_is_not_one_object_moving():
    hallway = next_state(
        frozenset(),
        "This room is called the hallway. In it, you see: \n\tthe agent\n"
        "\ta substance called air\n\ta picture\nYou also see:\n"
        "\tA door to the kitchen (that is open)",
    )
    both = next_state(hallway, KITCHEN)
    assert {"in(air, hallway)", "in(air, kitchen)"} <= both


def test_reset_task_clears_focus_and_eating_removes_the_object():
    s = frozenset({"focus(water)", "in(orange, inventory)"})
    assert next_state(s, "You reset the goal progress and focus.") == {"in(orange, inventory)"}
    assert next_state(s, "The orange was delicious.") == {"focus(water)"}


def test_delta_f1_scores_predictions_against_the_real_change():
    before = next_state(frozenset(), KITCHEN)
    real = "You move the thermometer to the inventory."
    assert state_delta_f1(next_state, before, real, real) == 1.0
    assert state_delta_f1(next_state, before, "You move the lighter to the inventory.", real) == 0.0
    # the right destination but a listing that also (wrongly) says nothing else moved: partial credit
    assert (
        0.0
        < state_delta_f1(
            next_state,
            before,
            "In your inventory, you see:\n\ta thermometer, currently reading a temperature of 10 degrees celsius",
            real,
        )
        <= 1.0
    )
    assert state_delta_f1(next_state, before, "garbled text.", real) == 0.0


def test_environment_registry_returns_the_scienceworld_parser():
    assert get_fact_parser("scienceworld") is parse_facts and get_next_state("scienceworld") is next_state
