"""World-model warm-up on failures too: the exploratory actions and how the
broker stores their transitions (for the world model only, never as demonstrations)."""

from __future__ import annotations

import random

import msgpack

from actors.explore import entities, explore_action, inadmissible_candidates
from broker.ingest import Ingest
from comap_async.config import ActorConfig
from comap_async.method.gates import SampleRule, canonical_action
from comap_async.wire.protocol import validate
from tests.fixtures.broker import make_transition

# admissible commands of a real ALFWorld state (at desk 1, the alarm clock in hand)
AT_DESK = (
    "examine alarmclock 2",
    "examine desk 1",
    "go to bed 1",
    "go to drawer 1",
    "go to desk 1",
    "help",
    "inventory",
    "look",
    "move alarmclock 2 to desk 1",
    "take pen 1 from desk 1",
    "use desklamp 1",
)
START = ("go to bed 1", "go to desk 1", "go to drawer 1", "help", "inventory", "look")


def test_entities_of_an_admissible_list():
    objects, receptacles = entities(AT_DESK)
    assert objects == ["alarmclock 2", "desklamp 1", "pen 1"]
    assert receptacles == ["bed 1", "desk 1", "drawer 1"]


def test_inadmissible_candidates_are_built_from_entities_and_never_admissible():
    cands = inadmissible_candidates(AT_DESK)
    assert {"take pen 1 from bed 1", "open alarmclock 2", "go to pen 1", "open drawer 1"} <= set(cands)
    assert "take pen 1 from desk 1" not in cands and not {canonical_action(a) for a in AT_DESK} & set(cands)
    assert inadmissible_candidates(START)  # receptacles alone still give some (open/use where one is not)


def test_explore_action_is_seeded_and_never_the_expert():
    picks = [explore_action(random.Random(i), AT_DESK, "take pen 1 from desk 1", 0.5) for i in range(200)]
    assert picks == [explore_action(random.Random(i), AT_DESK, "take pen 1 from desk 1", 0.5) for i in range(200)]
    assert "take pen 1 from desk 1" not in picks and "help" not in picks and None not in picks
    invalid = [p for p in picks if p not in AT_DESK]
    assert 50 < len(invalid) < 150  # about half inadmissible
    assert all(p in AT_DESK for p in (explore_action(random.Random(i), AT_DESK, "look", 0.0) for i in range(50)))
    assert all(p not in AT_DESK for p in (explore_action(random.Random(i), AT_DESK, "look", 1.0) for i in range(50)))
    assert explore_action(random.Random(0), ("look",), "look", 0.0) is None  # nothing else to try


def test_explore_share_is_configurable_with_a_default():
    assert ActorConfig().warmup_explore == 0.3 and ActorConfig(warmup_explore=0.0).warmup_explore == 0.0


def test_broker_stores_an_explore_transition_for_the_world_model_only():
    ingest = Ingest(SampleRule())
    tr = make_transition(
        3,
        phase="warmup",
        id="a0:ep0:3:x",
        explore=True,
        a_draft="open apple 1",
        a_ref="open apple 1",
        a_exec="open apple 1",
        s_next="Nothing happens.",
    )
    raw = msgpack.packb({**tr, "seq": 1})
    item = ingest.prepare(validate({**tr, "seq": 1}), raw)
    assert [store for store, _ in item.records] == ["transitions"] and dict(item.records)["transitions"] == raw
    assert item.counters == {"stored_transitions": 1, "stored_explore": 1} and item.dedup_key == b"t:a0:ep0:3:x"
    # the expert's own step still makes a demonstration
    expert = make_transition(3, phase="warmup", explore=False)
    item = ingest.prepare(validate({**expert, "seq": 2}), msgpack.packb({**expert, "seq": 2}))
    assert sorted(store for store, _ in item.records) == ["demos", "transitions"]
