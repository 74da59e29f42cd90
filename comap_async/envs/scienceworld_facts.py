"""Canonical facts of ScienceWorld observation text (a pure parser: no scienceworld, no JVM).

ScienceWorld describes the world with one recursive grammar: a room listing (``This room is
called the kitchen. In it, you see:`` then one object per line), an inventory, ``look in`` and
``look at`` are all lists of *object descriptions*, and a description nests further ones
(``a counter. On the counter is: a bowl (containing a red apple, a banana), a drawer.``). So this
module is a small recursive-descent parser of that grammar plus the fixed sentences that actions
answer with (``You move the thermometer to the inventory.``, ``The stove is now activated.``).

Facts: ``at(room)``; ``in(o, h)`` for an object directly in a holder (a room, ``inventory``, a
container or surface); ``empty(h)``; ``open(x)``/``closed(x)``, ``on(x)``/``off(x)``;
``reading(x, v)`` (a thermometer's temperature, a stopwatch's ticks); ``connected(a, b)``
(electrical terminals, sorted pair); ``focus(x)``; ``made(x)`` (a mixture produced);
``burning(x)``; ``broken(x)``. Names lose their article and ``substance called``; a living
thing's name keeps its stage (``pea plant in the adult stage``), so growing is a change of name.
Failed or informational answers (``No known action matches that input.``, an ambiguity prompt)
give :data:`~comap_async.facts.NO_CHANGE`; time passing, the task text and a recipe give no facts.

Text the grammar does not cover is unreadable: :func:`parse_facts` returns ``None``, so a
garbled prediction scores 0 and a real observation of an unknown form is not scored.
"""

from __future__ import annotations

import functools
import re

from comap_async.facts import NO_CHANGE

_LISTED = "listed("  # a complete listing of a holder's contents (see next_state); not a fact
_POURED = "poured("  # the contents of x moved into y
_GONE = "gone("  # an object no longer exists (eaten)
_UNFOCUS = "unfocus()"
_MOVED = "moved("  # an object was moved: it left whatever held it (a listing names things, and two
# rooms' air or water share a name, so only a move says an object left its other holder)
_MARKERS = (_LISTED, _POURED, _GONE, _UNFOCUS, _MOVED)  # instructions to next_state, not facts

_WORD = r"[A-Za-z0-9%'-]+"
_HEAD = re.compile(rf"(?:(?:an?|the|An?|The) )?(?P<name>{_WORD}(?: (?:{_WORD}|\((?!containing |that is )[^()]*\)))*)")
_STATE_WORDS = {"on": "on", "off": "off", "activated": "on", "deactivated": "off", "open": "open", "closed": "closed"}


def canonical(name: str) -> str:
    """An object's name as facts spell it: no article, no ``substance called``, single spaces."""
    name = " ".join(name.split())
    name = re.sub(r"^(?:an?|the|An?|The) ", "", name)
    return re.sub(r"^substance called ", "", name)


class _Unreadable(Exception):
    pass


class _Parser:
    """Recursive descent over one observation; ``facts`` collects what it reads."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.facts = text, 0, []

    def match(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        m = pattern.match(self.text, self.pos)
        if m:
            self.pos = m.end()
        return m

    def entry(self) -> str:
        """One object description; returns its canonical name."""
        m = self.match(_HEAD)
        if not m:
            raise _Unreadable
        name = canonical(m.group("name"))
        while self.clause(name):
            pass
        return name

    def listing(self, holder: str) -> None:
        """``nothing`` or descriptions separated by commas (a description's own ``, which is`` is
        one of its clauses, tried first)."""
        self.facts.append(f"{_LISTED}{holder})")
        if self.match(_NOTHING):
            self.facts.append(f"empty({holder})")
            return
        while True:
            self.contained(self.entry(), holder)
            if not self.match(_COMMA):
                return

    def lines(self, holder: str) -> None:
        """Descriptions one per ``\\n\\t`` line (room listings, inventory, ``look in``)."""
        self.facts.append(f"{_LISTED}{holder})")
        seen = False
        while self.match(_LINE):
            seen = True
            if self.match(_NOTHING_LINE):
                self.facts.append(f"empty({holder})")
                continue
            self.contained(self.entry(), holder)
            self.match(_LINE_END)
        if not seen:
            raise _Unreadable

    def contained(self, name: str, holder: str) -> None:
        if name != "agent":  # the agent's place is at(...)
            self.facts.append(f"in({name}, {holder})")

    def clause(self, name: str) -> bool:
        for pattern, handle in _CLAUSES:
            m = self.match(pattern)
            if m:
                handle(self, name, m)
                return True
        return False


def _containing(p: _Parser, name: str, m: re.Match[str]) -> None:
    p.listing(name)
    if not p.match(_CLOSE):
        raise _Unreadable


def _surface(p: _Parser, name: str, m: re.Match[str]) -> None:
    holder = canonical(m.group(1))
    if name.startswith(holder):  # "a pea plant in the adult stage. On the pea plant you see: ..."
        holder = name
    if p.match(_LINE_AHEAD):  # the multi-line form ("On the table is: \n\tnothing")
        p.lines(holder)
    else:
        p.listing(holder)
        p.match(_PERIOD)


def _state(p: _Parser, name: str, m: re.Match[str]) -> None:
    # one group: the state of the described object; two: of the object the clause names
    target = name if m.lastindex == 1 else canonical(m.group(1))
    p.facts.append(f"{_STATE_WORDS[m.group(m.lastindex)]}({target})")


def _connections(p: _Parser, name: str, m: re.Match[str]) -> None:
    """``its anode is connected to: ...`` (a part of ``name``) or ``it is connected to: ...`` (a terminal)."""
    terminal, others = (f"{m.group(1)} on {name}", m.group(2)) if m.lastindex == 2 else (name, m.group(1))
    if others != "nothing":
        for other in others.split(", "):
            p.facts.append(_connected(terminal, other))


def _connected(a: str, b: str) -> str:
    x, y = sorted((canonical(a), canonical(b)))
    return f"connected({x}, {y})"


_NOTHING = re.compile(r"nothing\b")
_NOTHING_LINE = re.compile(r"nothing(?=\n|$)")
_COMMA = re.compile(r" ?, (?!which |currently |with: )")
_CLOSE = re.compile(r" ?\)")
_PERIOD = re.compile(r"\.")
_LINE = re.compile(r"[ \n]*\n\t")
_LINE_AHEAD = re.compile(r" ?(?=\n\t)")
_LINE_END = re.compile(r" *(?=\n|$)")
_CLAUSES = [
    (re.compile(r" \(containing "), _containing),
    (re.compile(r" \(that is (open|closed)\)"), _state),
    (re.compile(r" \(that looks unwell\)"), lambda p, n, m: p.facts.append(f"unwell({n})")),
    (re.compile(r", which is (?:turned )?(on|off|activated|deactivated|open|closed)\.?"), _state),
    (
        re.compile(r", currently reading a temperature of (-?\d+(?:\.\d+)?) degrees celsius"),
        lambda p, n, m: p.facts.append(f"reading({n}, {m.group(1)} degrees celsius)"),
    ),
    (re.compile(rf"\.? ?The ({_WORD}(?: {_WORD})*?) door is (open|closed)\. ?"), _state),
    (re.compile(rf"\.? ?The ({_WORD}(?: {_WORD})*?) is (open|closed)\.? ?"), _state),
    (re.compile(rf"\.? ?(?:On|In|Inside) the ({_WORD}(?: {_WORD})*?) (?:is|you see): ?"), _surface),
    (
        re.compile(r"\.? ?The time reads (\d+) ticks\. ?"),
        lambda p, n, m: p.facts.append(f"reading({n}, {m.group(1)} ticks)"),
    ),
    (re.compile(r", with: "), lambda p, n, m: p.listing(n)),
    (re.compile(r"\.? ?its ((?:terminal \d+|anode|cathode)) is connected to: (nothing|[^.]+)\. ?"), _connections),
    (re.compile(r"\.? ?it is connected to: (nothing|[^.]+)\. ?"), _connections),
    (re.compile(r"\.? ?The artist is listed as [A-Za-z]+\. ?"), lambda p, n, m: None),
]
_DISCONNECTING = re.compile(r"^\((?:disconnecting [^()\n]*(?:\([^()]*\))?)\)\n?")
_GLUED_ITS = re.compile(r"(?<=[a-z])its (?=terminal|anode|cathode)")


def _moved(obj: str, holder: str) -> list[str]:
    obj, holder = canonical(obj), canonical(holder)
    return [f"{_MOVED}{obj})", f"in({obj}, {holder})"]


_N = rf"{_WORD}(?: (?:{_WORD}|\([^()]*\)))*?"  # a lazy name inside a fixed sentence
# Whole observations: (pattern, facts); the room, inventory and look-in forms are parsed below.
_SENTENCES: list[tuple[re.Pattern[str], object]] = [
    (re.compile(p + r"\s*$", re.DOTALL), f)
    for p, f in [
        (rf"You (?:move|teleport) to the ({_N})\.", lambda m: [f"at({canonical(m.group(1))})"]),
        (rf"You move through the door to the ({_N})\.", lambda m: [f"at({canonical(m.group(1))})"]),
        (rf"You move the ({_N}) to the ({_N})\.", lambda m: _moved(m.group(1), m.group(2))),
        (
            rf"You pour the contents of the ({_N}) into the ({_N})\.",
            lambda m: [
                f"{_POURED}{canonical(m.group(1))}, {canonical(m.group(2))})",
                f"empty({canonical(m.group(1))})",
            ],
        ),
        (rf"You pour the ({_N}) into the ({_N})\.", lambda m: _moved(m.group(1), m.group(2))),
        (
            rf"You dunk the {_N} in the {_N}, moving the liquids \(({_N})\) to the ({_N})\.",
            lambda m: _moved(m.group(1), m.group(2)),
        ),
        (
            rf"The ({_N}) is now (open|closed|activated|deactivated)\.",
            lambda m: [f"{_STATE_WORDS[m.group(2)]}({canonical(m.group(1))})"],
        ),
        (
            rf"The ({_N}) is already (open|closed|activated|deactivated)\.",
            lambda m: [f"{_STATE_WORDS[m.group(2)]}({canonical(m.group(1))})"],
        ),
        (rf"({_N}) is now connected to ({_N})", lambda m: [_connected(m.group(1), m.group(2))]),
        (rf"You focus on the ({_N})\.", lambda m: [f"focus({canonical(m.group(1))})"]),
        (r"You reset the goal progress and focus\.", lambda m: [_UNFOCUS]),
        (
            r"the thermometer measures a temperature of (-?\d+(?:\.\d+)?) degrees celsius",
            lambda m: [f"reading(thermometer, {m.group(1)} degrees celsius)"],
        ),
        (
            rf"[A-Z][a-z-]+(?:,? (?:and )?[a-z-]+)*(?: paint)? mix to produce ({_N})\.",
            lambda m: [f"made({m.group(1)})"],
        ),
        (rf"The ({_N}) (?:catches fire|is already on fire)\.", lambda m: [f"burning({canonical(m.group(1))})"]),
        (rf"The ({_N}) was delicious\.", lambda m: [f"{_GONE}{canonical(m.group(1))})"]),
        (
            rf"The ({_N}) appears broken, and can't be activated or deactivated\.",
            lambda m: [f"broken({canonical(m.group(1))})"],
        ),
        (rf"You hit the ({_N}) with the {_N}, causing it to break\.", lambda m: [f"broken({canonical(m.group(1))})"]),
        (r"You dig a hole in the ground, and place the soil nearby\.", lambda m: ["dug(ground)"]),
        # time passes or information only: the state is what it was (time's effects show when observed)
        (r"You decide to wait for \d+ iterations?\.", lambda m: []),
        (r"Task [Dd]escription:\n.*", lambda m: []),
        (rf"The {_N} reads:\n.*", lambda m: []),
        (rf"The {_N} is now flushing\.", lambda m: []),
        (rf"The lighter heats up the {_N} a small amount\.", lambda m: []),
        # failed, refused or ambiguous actions change nothing
        (
            r"Ambiguous request: Please enter the number for the action you intended \(or blank to cancel\):\n.*",
            lambda m: [NO_CHANGE],
        ),
        (r"No known action matches that input\.", lambda m: [NO_CHANGE]),
        (
            r"Unknown action\.  Type 'help' for a list of actions, "
            r"and 'objects' for a list of possible object referents\.",
            lambda m: [NO_CHANGE],
        ),
        (r"That container is empty, so there are no items to mix\.", lambda m: [NO_CHANGE]),
        (rf"There is only one thing \({_N}\)", lambda m: [NO_CHANGE]),
        (rf"Mixing the contents of the {_N} does not appear to produce anything new\.", lambda m: [NO_CHANGE]),
        (r"I'm not sure how to use those two things together\.", lambda m: [NO_CHANGE]),
        (r"It's not clear how to use those items together\.", lambda m: [NO_CHANGE]),
        (r"You can't move something into itself\.", lambda m: [NO_CHANGE]),
        (r"You can't pick up a gas directly\.", lambda m: [NO_CHANGE]),
        (rf"The {_N} does not contain any liquids to dunk into\.", lambda m: [NO_CHANGE]),
        (rf"The {_N} is not moveable\.", lambda m: [NO_CHANGE]),
        (r"That thing doesn't appear to have a temperature that the thermometer can read\.", lambda m: [NO_CHANGE]),
        (rf"There is nothing in the {_N}\.", lambda m: [NO_CHANGE]),
    ]
]
_ROOM = re.compile(rf"This (?:room|outside location) is called the ({_N})\. (?:In it,|Here) you see:")
_INVENTORY = re.compile(r"In your inventory, you see:")
_INSIDE = re.compile(rf"Inside the ({_N}) is:")
_ALSO_LINES = re.compile(r"[ \n]*\nYou also see:")
_ALSO_INLINE = re.compile(r"[ \n]*\n You also see: ")
_END = re.compile(r"\s*$")


def _sentence_facts_uncached(text: str) -> list[str]:
    text = _DISCONNECTING.sub("", text)  # moving a wired object first unplugs it: said before the result
    for pattern, build in _SENTENCES:
        m = pattern.match(text)
        if m:
            return build(m)  # type: ignore[operator]
    p = _Parser(_GLUED_ITS.sub(". its ", text))
    if m := p.match(_ROOM):
        room = canonical(m.group(1))
        p.facts.append(f"at({room})")
        p.lines(room)
        if p.match(_ALSO_LINES):
            while p.match(_LINE):
                p.entry()
                p.match(_LINE_END)
    elif p.match(_INVENTORY):
        p.lines("inventory")
    elif m := p.match(_INSIDE):
        holder = canonical(m.group(1))
        p.lines(holder)
        if p.match(_ALSO_INLINE):  # doors and drains, not contents
            p.entry()
            while p.match(_COMMA):
                p.entry()
            p.match(_PERIOD)
    elif text[:1].islower() or text.startswith("A "):  # look at: one description
        p.entry()
        p.match(_PERIOD)
    else:
        raise _Unreadable
    if not p.match(_END):
        raise _Unreadable
    return p.facts


@functools.lru_cache(maxsize=8192)
def _sentence_facts(text: str) -> tuple[str, ...] | None:
    """Facts with the listing markers; None when unreadable. Cached: texts recur."""
    text = text.strip()
    if not text:
        return None
    try:
        facts = _sentence_facts_uncached(text)
    except _Unreadable:
        return None
    return tuple(facts)


def parse_facts(text: str) -> frozenset[str] | None:
    """The canonical facts of one observation, or ``None`` when any part of it is unreadable."""
    facts = _sentence_facts(text)
    if facts is None:
        return None
    return frozenset(f for f in facts if not f.startswith(_MARKERS))


def _arg(fact: str) -> str:
    return fact[fact.index("(") + 1 : -1]


def _pair(fact: str) -> tuple[str, str]:
    a, b = _arg(fact).rsplit(", ", 1)
    return a, b


_OPPOSITE = {"open": "closed", "closed": "open", "on": "off", "off": "on"}


def next_state(state: frozenset[str], text: str) -> frozenset[str] | None:
    """The state's canonical facts after observing ``text``; ``None`` when ``text`` is unreadable.

    What the text does not mention stays as last seen. What it says replaces what contradicts
    it: one location; a moved object leaves its other holder; a complete listing of a holder replaces its
    remembered contents; open/closed and on/off exclude each other; one reading per instrument.
    Pouring moves the remembered contents of one holder into another; an eaten object is gone.
    """
    facts = _sentence_facts(text)
    if facts is None:
        return None
    if not facts or NO_CHANGE in facts:
        return state
    s = set(state)
    if any(f.startswith("at(") for f in facts):
        s = {f for f in s if not f.startswith("at(")}
    listed = {_arg(f) for f in facts if f.startswith(_LISTED)}
    if listed:
        s = {
            f
            for f in s
            if not ((f.startswith("in(") and _pair(f)[1] in listed) or (f.startswith("empty(") and _arg(f) in listed))
        }
    for f in facts:
        if f.startswith(_LISTED):
            continue
        if f.startswith(_MOVED):
            obj = _arg(f)
            s = {g for g in s if not (g.startswith("in(") and _pair(g)[0] == obj)}
            continue
        if f == _UNFOCUS:
            s = {g for g in s if not g.startswith("focus(")}
            continue
        pred, arg = f[: f.index("(")], _arg(f)
        if pred == "in":
            s.discard(f"empty({_pair(f)[1]})")
        elif f.startswith(_POURED):
            src, dst = _pair(f)
            moved = [_pair(g)[0] for g in s if g.startswith("in(") and _pair(g)[1] == src]
            s = {g for g in s if not (g.startswith("in(") and _pair(g)[1] == src)}
            s |= {f"in({o}, {dst})" for o in moved}
            if moved:
                s.discard(f"empty({dst})")
            continue
        elif f.startswith(_GONE):
            s = {g for g in s if not (g.startswith("in(") and _pair(g)[0] == arg)}
            continue
        elif pred == "reading":
            instrument = _pair(f)[0]
            s = {g for g in s if not (g.startswith("reading(") and _pair(g)[0] == instrument)}
        elif pred in _OPPOSITE:
            s.discard(f"{_OPPOSITE[pred]}({arg})")
        s.add(f)
    return frozenset(s)
