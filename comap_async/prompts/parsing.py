"""Reading the model's answers: actions, ReAct answers, reflections (the gate's ``p`` and ``q`` are
:mod:`comap_async.method.decision`'s)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ACTION_PREFIX = re.compile(r"^\s*(?:>|action\s*:|final action\s*:|command\s*:|\d+[.)])\s*", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Parsed:
    value: str | None
    """The parsed text, or None when nothing usable was found."""
    problem: str | None = None
    """What could not be parsed (for counters), None when clean."""


_PLACEHOLDER = re.compile(r"^<[^<>]*>$")


def parse_action(text: str) -> Parsed:
    """First non-empty line, without prompt-like prefixes, quotes and trailing punctuation. The
    prompts' own placeholder copied back (``<one command>``) is no action."""
    for line in text.splitlines():
        line = _ACTION_PREFIX.sub("", line).strip().strip("\"'`").rstrip(".!").strip()
        if line:
            if _PLACEHOLDER.match(line):
                return Parsed(None, "placeholder")
            return Parsed(line, None if line == text.strip() else "extra_text")
    return Parsed(None, "empty")


_REACT_ACTION = re.compile(r"^\s*action\s*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)


def parse_react(completion: str) -> Parsed:
    """The command on the last ``Action:`` line of a ReAct answer (generated after ``Thought:``)."""
    found = _REACT_ACTION.findall(completion)
    if not found:
        return Parsed(None, "no_action")
    return parse_action(found[-1])


@dataclass(frozen=True, slots=True)
class Reflection:
    decision: str | None
    """KEEP, REVISE, or None when unreadable."""
    final_action: str | None
    """The action after ``Final Action:``, or None."""
    problem: str | None = None


_DECISION = re.compile(r"\b(KEEP|REVISE)\b", re.IGNORECASE)
_FINAL = re.compile(r"final\s*action\s*:\s*(.+)", re.IGNORECASE)


def parse_reflection(completion: str) -> Reflection:
    """Parse the text generated after the ``Decision:`` prefix (or a full answer that repeats it)."""
    text = completion.strip()
    first = text.splitlines()[0] if text else ""
    m = _DECISION.search(first.split(":", 1)[-1] if first.lower().startswith("decision") else first)
    decision = m.group(1).upper() if m else None
    fm = _FINAL.search(text)
    final = parse_action(fm.group(1)).value if fm else None
    problem = None if decision and final else ("no_decision" if not decision else "no_final_action")
    return Reflection(decision, final, problem)
