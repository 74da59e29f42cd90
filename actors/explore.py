"""Exploratory actions of the world-model warm-up (docs/design.md section 11, eq. 4-5).

Walkthroughs only ever show the expert's successful commands, so a world model warmed up on them
alone has never seen ``Nothing happens.``, a wrong receptacle or a refused take. During warm-up a
share of steps also executes one of these actions (on a second environment restored to the
expert path) and records that real transition for the world model only.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from comap_async.method.gates import canonical_action

_ENTITY = re.compile(r"[a-z][a-z]* \d+")
_TAKE = re.compile(r"^take (?P<obj>.+?) from (?P<rec>.+)$")
_MOVE = re.compile(r"^(?:move|put) (?P<obj>.+?) (?:to|in/on|in|on) (?P<rec>.+)$")
_WITH = re.compile(r"^(?:heat|cool|clean|slice) (?P<obj>.+?) with (?P<rec>.+)$")
_GO = re.compile(r"^go to (?P<rec>.+)$")
_SKIP = ("help",)  # admissible but says nothing about the world


def entities(admissible: Sequence[str]) -> tuple[list[str], list[str]]:
    """(objects, receptacles) named in an admissible list: receptacles are what one can ``go to``
    or take from / put into / use with; objects are what one can take, move, heat... Sorted."""
    objects: set[str] = set()
    receptacles: set[str] = set()
    for cmd in admissible:
        c = cmd.strip().lower()
        if m := _GO.match(c):
            receptacles.add(m["rec"])
        elif m := (_TAKE.match(c) or _MOVE.match(c) or _WITH.match(c)):
            objects.add(m["obj"])
            receptacles.add(m["rec"])
    named = {e for cmd in admissible for e in _ENTITY.findall(cmd.lower())}
    objects |= named - receptacles - objects
    return sorted(objects), sorted(receptacles)


def inadmissible_candidates(admissible: Sequence[str]) -> list[str]:
    """Commands built from the entities of ``admissible`` that are not in it (the game answers
    ``Nothing happens.``): take an object from the wrong receptacle, open/close/go to an object,
    open or use a receptacle one is not at. Sorted, so a seeded choice is reproducible."""
    objects, receptacles = entities(admissible)
    allowed = {canonical_action(a) for a in admissible}
    out: set[str] = set()
    for o in objects:
        out.update((f"open {o}", f"close {o}", f"go to {o}"))
        out.update(f"take {o} from {r}" for r in receptacles)
    for r in receptacles:
        out.update((f"open {r}", f"use {r}"))
    return sorted(c for c in out if canonical_action(c) not in allowed)


def explore_action(
    rng: random.Random, admissible: Sequence[str], expert: str | None, invalid_share: float
) -> str | None:
    """A non-expert action for the state whose commands are ``admissible``: with probability
    ``invalid_share`` an inadmissible one (:func:`inadmissible_candidates`), else an admissible
    command other than the expert's; either kind when the other has no candidate. None when
    there is nothing to try."""
    skip = {canonical_action(expert)} if expert else set()
    valid = sorted(a for a in admissible if a.strip().lower() not in _SKIP and canonical_action(a) not in skip)
    invalid = [c for c in inadmissible_candidates(admissible) if canonical_action(c) not in skip]
    want_invalid = rng.random() < invalid_share
    pool = (invalid or valid) if want_invalid else (valid or invalid)
    return rng.choice(pool) if pool else None
