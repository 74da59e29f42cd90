"""Canonical facts of ALFWorld observation text (a pure parser: no alfworld, textworld or torch).

The broker calls :func:`parse_facts` on every stored transition (real and predicted observations)
for Delta-F1 and the world-state gate, so it is a loop of anchored regular expressions over the
fixed templates of ``alfred.twl2`` (alfworld 0.4.x), one per observation sentence family.

A fact set describes what one observation says about the world, plus what the sentence implies
without doubt (you can only pick something up from the receptacle you stand at, so
``You pick up the apple 1 from the countertop 1.`` also gives ``at(countertop 1)``). Implied
locations keep ``at(...)`` stable across steps, so the action-induced change is not blurred by
a location that the text merely stopped mentioning.

Facts: ``at(r)`` (``at(room)`` in the middle of the room), ``holding(o)`` (``holding(nothing)``),
``in(o, r)``, ``empty(r)``, ``open(r)``, ``closed(r)``, ``near(o)`` (on the floor next to you),
``hot(o)``, ``cool(o)``, ``clean(o)``, ``sliced(o)``, ``on(o)``, ``off(o)``, ``plain(o)``.
Failed or informational actions (``Nothing happens.``, ``help``, a missing switch) give
:data:`~comap_async.facts.NO_CHANGE`: the state after them is the state before.

Text that is not entirely made of known sentences is unreadable: :func:`parse_facts` returns
``None`` rather than a guess, so a garbled prediction scores 0 instead of partial credit.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from comap_async.facts import NO_CHANGE

# Entity names as the ALFWorld demangler writes them: a lower-case class and an instance number.
_NAME = r"[a-z]+ \d+"
_ITEM = rf"an? {_NAME}"
_LIST = rf"nothing|{_ITEM}(?:,? (?:and )?{_ITEM})*"
_NAMES = rf"{_NAME}(?:,? (?:and )?{_NAME})*"
_NAME_RE = re.compile(_NAME)
_LISTED = "listed("  # marker of a complete contents listing (see _contents)
_ADJECTIVES = {"hot": "hot", "cool": "cool", "cold": "cool", "clean": "clean", "sliced": "sliced"}

FactBuilder = Callable[[re.Match[str]], list[str]]


def _names(text: str) -> list[str]:
    return _NAME_RE.findall(text)


def _contents(receptacle: str, listing: str) -> list[str]:
    # a listing is the receptacle's whole content: the marker tells next_state to forget the
    # contents it remembered there (parse_facts drops it: it is not a fact about the world)
    listed = f"{_LISTED}{receptacle})"
    if listing == "nothing":
        return [listed, f"empty({receptacle})"]
    return [listed, *(f"in({o}, {receptacle})" for o in _names(listing))]


def _adjectives(m: re.Match[str]) -> list[str]:
    obj = m.group(2)
    words = m.group(1).replace(" and ", " ").split()
    return [f"{_ADJECTIVES[w]}({obj})" for w in words]


_NO_CHANGE: FactBuilder = lambda m: [NO_CHANGE]  # noqa: E731

# (pattern, facts) in match order; every pattern ends at a sentence boundary.
_SENTENCES: list[tuple[str, FactBuilder]] = [
    (r"-= Welcome to TextWorld, ALFRED! =-", lambda m: []),
    # the task is not world state; its own line ends at the newline (it may lack a period)
    (r"Your task is to: [^\n]*", lambda m: []),
    (rf"You are in the middle of a room\. Looking quickly around you, you see (?:{_LIST})\.", lambda m: ["at(room)"]),
    (
        rf"You are facing the ({_NAMES})\. Next to it, you see ({_LIST})\.",
        lambda m: (
            [f"at({r})" for r in _names(m.group(1))]
            + ([] if m.group(2) == "nothing" else [f"near({o})" for o in _names(m.group(2))])
        ),
    ),
    (rf"You arrive at ({_NAME})\.", lambda m: [f"at({m.group(1)})"]),
    (rf"You open the ({_NAME})\.", lambda m: [f"at({m.group(1)})", f"open({m.group(1)})"]),
    (rf"You close the ({_NAME})\.", lambda m: [f"at({m.group(1)})", f"closed({m.group(1)})"]),
    (
        rf"The ({_NAME}) is open\. In it, you see ({_LIST})\.",
        lambda m: [f"at({m.group(1)})", f"open({m.group(1)})", *_contents(m.group(1), m.group(2))],
    ),
    (rf"The ({_NAME}) is closed\.", lambda m: [f"at({m.group(1)})", f"closed({m.group(1)})"]),
    (rf"On the ({_NAME}), you see ({_LIST})\.", lambda m: [f"at({m.group(1)})", *_contents(m.group(1), m.group(2))]),
    (
        rf"You pick up the ({_NAME}) from the ({_NAME})\.",
        lambda m: [f"holding({m.group(1)})", f"at({m.group(2)})"],
    ),
    (rf"You move the ({_NAME}) to the ({_NAME})\.", lambda m: [f"in({m.group(1)}, {m.group(2)})", f"at({m.group(2)})"]),
    # receptacle-object variants (mugs, pans, ...) keep their action name as a prefix in 0.4.x
    (
        rf"Pickup(?:ObjectFromReceptacleObject|EmptyReceptacleObject|FullReceptacleObject): "
        rf"You pick up the ({_NAME})\.",
        lambda m: [f"holding({m.group(1)})"],
    ),
    (
        rf"Put(?:ObjectInReceptacleObject|EmptyReceptacleObjectinReceptacle|FullReceptacleObjectInReceptacle): "
        rf"You put the ({_NAME}) in the ({_NAME})\.",
        lambda m: [f"in({m.group(1)}, {m.group(2)})"],
    ),
    (
        rf"You are carrying: ((?:{_ITEM})(?:,? (?:and )?{_ITEM})*)\.",
        lambda m: [f"holding({o})" for o in _names(m.group(1))],
    ),
    (r"You are not carrying anything\.", lambda m: ["holding(nothing)"]),
    (rf"This is a normal ({_NAME})\. In it, you see ({_LIST})\.", lambda m: _contents(m.group(1), m.group(2))),
    (rf"This is a ((?:(?:hot|cool|cold|clean|sliced)(?: and)? )+)({_NAME})\.", _adjectives),
    (rf"This ({_NAME}) is (on|off)\.", lambda m: [f"{m.group(2)}({m.group(1)})"]),
    (rf"There's nothing special about ({_NAME})\.", lambda m: [f"plain({m.group(1)})"]),
    (rf"You turn (on|off) the ({_NAME})\.", lambda m: [f"{m.group(1)}({m.group(2)})"]),
    (
        rf"You (heat|clean|cool) the ({_NAME}) using the ({_NAME})\.",
        lambda m: [
            f"{m.group(1)}({m.group(2)})".replace("heat(", "hot("),
            f"holding({m.group(2)})",
            f"at({m.group(3)})",
        ],
    ),
    (rf"You sliced the ({_NAME}) with the ({_NAME})\.", lambda m: [f"sliced({m.group(1)})", f"holding({m.group(2)})"]),
    (r"Nothing happens\.", _NO_CHANGE),
    (rf"You don't see any switch on the ({_NAME})\.", _NO_CHANGE),
    # the help text is a fixed block that runs to the end of the observation
    (r"Available commands:\n.*", _NO_CHANGE),
]

_COMPILED = [(re.compile(p, re.DOTALL if p.startswith("Available") else 0), build) for p, build in _SENTENCES]
# cheap dispatch: candidate patterns by the sentence's first two characters
_BY_PREFIX: dict[str, list[tuple[re.Pattern[str], FactBuilder]]] = {}
for _pattern, _build in _COMPILED:
    _BY_PREFIX.setdefault(_pattern.pattern[:2], []).append((_pattern, _build))
_SPACE = re.compile(r"\s+")


@functools.lru_cache(maxsize=8192)
def _sentence_facts(text: str) -> tuple[str, ...] | None:
    """Facts of every sentence in order, with the listing markers; None when unreadable.
    Cached: the same texts recur (a step's observation is the next step's previous one, the
    student and the teacher often predict the same sentence, ``Nothing happens.`` is everywhere)."""
    if not text.strip():
        return None  # empty text says nothing
    facts: list[str] = []
    pos, end = 0, len(text)
    while True:
        gap = _SPACE.match(text, pos)
        if gap:
            pos = gap.end()
        if pos >= end:
            break
        for pattern, build in _BY_PREFIX.get(text[pos : pos + 2], ()):
            m = pattern.match(text, pos)
            if m:
                facts.extend(build(m))
                pos = m.end()
                break
        else:
            return None
    if NO_CHANGE in facts and len(facts) > 1:
        return None  # "Nothing happens." next to a state change contradicts itself
    return tuple(facts)


def parse_facts(text: str) -> frozenset[str] | None:
    """The canonical facts of one observation, or ``None`` when any part of it is unreadable."""
    facts = _sentence_facts(text)
    if facts is None:
        return None
    return frozenset(f for f in facts if not f.startswith(_LISTED))


def _arg(fact: str) -> str:
    return fact[fact.index("(") + 1 : -1]


_OPPOSITE = {"open": "closed", "closed": "open", "on": "off", "off": "on", "hot": "cool", "cool": "hot"}


def next_state(state: frozenset[str], text: str) -> frozenset[str] | None:
    """The state's canonical facts after the agent observes ``text`` (docs/design.md section 11: ``C``
    is over the state, not over one observation); ``None`` when ``text`` is unreadable.

    What an observation does not mention stays as last seen: the contents and open/closed state
    of receptacles the agent walked away from, object states, what it holds. What it does say
    replaces what contradicts it: one location (leaving it also forgets the objects ``near`` it),
    one place per object (taken: no longer in a receptacle; put somewhere: no longer held or
    elsewhere), a complete listing of a receptacle's contents replaces the remembered contents,
    open/closed, on/off and hot/cool exclude each other. Empty hands are the absence of
    ``holding`` facts. A failed action (``Nothing happens.``) leaves the state as it was.
    """
    facts = _sentence_facts(text)
    if facts is None:
        return None
    if not facts or NO_CHANGE in facts:
        return state
    s = set(state)
    if any(f.startswith("at(") for f in facts):
        s = {f for f in s if not f.startswith(("at(", "near("))}
    listed = {_arg(f) for f in facts if f.startswith(_LISTED)}
    if listed:
        s = {
            f
            for f in s
            if not (
                (f.startswith("in(") and f[3:-1].split(", ")[1] in listed)
                or (f.startswith("empty(") and _arg(f) in listed)
            )
        }
    holding = [f for f in facts if f.startswith("holding(")]
    if holding:  # an inventory or a pick-up names everything held now
        s = {f for f in s if not f.startswith("holding(")}
        for f in holding:
            obj = _arg(f)
            if obj != "nothing":
                s = {g for g in s if not g.startswith(f"in({obj}, ")}
                s.add(f)
    for f in facts:
        if f.startswith((_LISTED, "holding(")):
            continue
        pred, arg = f[: f.index("(")], _arg(f)
        if pred == "in":
            obj, rec = arg.split(", ")
            s = {g for g in s if not g.startswith(f"in({obj}, ")}
            s.discard(f"holding({obj})")
            s.discard(f"empty({rec})")
        elif pred in _OPPOSITE:
            s.discard(f"{_OPPOSITE[pred]}({arg})")
        s.add(f)
    return frozenset(s)


# The same sentence grammar as one regular expression, for :func:`is_readable`: each sentence is
# an atomic group and the repetition possessive, so like parse_facts it commits to the first
# pattern that matches at a position and never tries another split of the text.
# Patterns are grouped by their first two (literal) characters, as parse_facts dispatches them:
# the engine then tries a handful of alternatives per sentence instead of all of them.
# Captures become plain groups: nothing is extracted, and Python 3.11's engine mis-tracks
# capture spans inside atomic groups (SystemError).
_GROUPS: dict[str, list[str]] = {}
for _p, _ in _SENTENCES:
    _body = re.sub(r"(?<!\\)\((?!\?)", "(?:", _p[2:])
    _GROUPS.setdefault(_p[:2], []).append(f"(?s:{_body})" if _p.startswith("Available") else f"(?:{_body})")
_READABLE = re.compile(
    r"(?:\s*+(?>" + "|".join(f"{re.escape(k)}(?>{'|'.join(v)})" for k, v in _GROUPS.items()) + r"))*+\s*+"
)
_NO_CHANGE_MARKS = ("Nothing happens.", "You don't see any switch", "Available commands:")


def is_readable(text: str) -> bool:
    """``parse_facts(text) is not None``, several times faster: no facts are built.

    The world-state gate only needs this when the student's and the teacher's predictions are
    the same text (their changes then agree whatever the facts are). Text with a failed-action
    sentence goes through :func:`parse_facts`, which also rejects one next to a state change.
    """
    if not text.strip() or _READABLE.fullmatch(text) is None:
        return False
    if any(mark in text for mark in _NO_CHANGE_MARKS):
        return parse_facts(text) is not None
    return True


parse_facts.is_readable = is_readable  # type: ignore[attr-defined]  # found by the broker's gate
next_state.is_readable = is_readable  # type: ignore[attr-defined]
