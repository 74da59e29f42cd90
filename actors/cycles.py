"""Ending a greedy evaluation episode that has entered a cycle, with the figures it would have had.

In an evaluation whose every model call is greedy (``eval.temperature`` 0, no sampled
look-ahead candidates), a step is a function of its textual state: the same state gives
the same draft, imagined result, reflection and executed action. When a state recurs, the steps
since its previous occurrence repeat until the episode's step cap, so the game is lost and the rest
of the episode is known without playing it. The small policies this system trains on a CPU repeat
an action from the same state on 85-97 % of their evaluation steps, so most evaluation time went
into such cycles.

``eval.cycle_stop`` (occurrences of one state that end the episode; 0: off) ends it there and
extends the episode's statistics as the remaining steps would have: each counter (revisions,
invalid actions, parse problems, gate reasons, Delta-F1 scores, the state-action pairs behind the
loop rate, judged steps) grows by the cycle's own per-step increments, repeated up to
``env.max_steps``. Success, mean steps and the rates are then those of the full episode. Two things
can break the premise, which is why the default waits for a third occurrence rather than the second:
an environment whose steps are not deterministic (ScienceWorld, for some tasks), and batched
decoding whose logits differ in the last bits with the batch's composition.

In the draft's turns form (``env.draft_turns``) the draft sees the episode's whole history, which does
not recur with the state, so the premise above does not hold by construction. The stop applies there
on a measured premise instead: the episode ends only when the stretches of states between the
state's last ``eval.cycle_stop`` occurrences are the same steps, i.e. the policy has already played
the cycle through ``cycle_stop - 1`` times with the cycle in its context, and is taken to play it
again. Measured, the projections had the played outcome in 11 of 11 recurring games, not every
per-step figure (docs/findings.md). ``experiments/studies/cycle_stop.py`` (``comap eval
--cycle-check``: :attr:`CycleStop.check`) measures how often that projection is exact for a given
model before a configuration relies on it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

COUNTERS = ("revisions", "invalid", "parse_problems", "reflection_problems", "unreadable_reflections")
"""Integer fields of :class:`~actors.episodes.EpisodeStats` that grow per step."""
SEQUENCES = ("delta_f1", "state_actions", "judged_steps", "lookahead")
"""List fields of :class:`~actors.episodes.EpisodeStats` that grow per step."""


def deterministic(cfg: Any, method: str) -> bool:
    """Whether every call of an evaluation episode of ``method`` is greedy under ``cfg``."""
    ev = cfg.eval
    return ev.temperature == 0 and method != "lookahead"


def cycle_stop_for(cfg: Any, method: str, check: bool = False) -> "CycleStop | None":
    """The episode's :class:`CycleStop` when ``eval.cycle_stop`` is on and the evaluation is greedy.
    With ``env.draft_turns`` on repeated cycles (:attr:`CycleStop.repeated`): the draft sees the whole
    history, which does not recur with the state, so a recurring state alone does not repeat its step.
    ``check``: play on and compare (:attr:`CycleStop.check`; ``comap eval --cycle-check``)."""
    if cfg.eval.cycle_stop <= 0 or not deterministic(cfg, method):
        return None
    return CycleStop(
        occurrences=cfg.eval.cycle_stop,
        max_steps=cfg.env.max_steps,
        check=check,
        repeated=cfg.env.draft_turns,
    )


@dataclass
class _Mark:
    """An episode's statistics at the start of one step."""

    counts: tuple[int, ...]
    lengths: tuple[int, ...]
    gate_reasons: dict[str, int]
    reward: float


def _mark(stats: Any) -> _Mark:
    return _Mark(
        counts=tuple(getattr(stats, name) for name in COUNTERS),
        lengths=tuple(len(getattr(stats, name)) for name in SEQUENCES),
        gate_reasons=dict(stats.gate_reasons),
        reward=stats.reward,
    )


@dataclass
class CycleStop:
    occurrences: int
    """Occurrences of one textual state that end the episode (at least 2)."""
    max_steps: int
    """The episode's step cap (``env.max_steps``): where the cycle would have ended it."""
    check: bool = False
    """``comap eval --cycle-check``: play on to the end and record whether the projection made at the
    first recurrence was exact (``EpisodeStats.cycle_check``), to measure the premise on an
    environment and model before relying on it."""
    repeated: bool = False
    """The turns form's condition: a recurrence counts only when the stretches of states between the
    state's last ``occurrences`` appearances are equal (the same cycle played ``occurrences - 1`` times),
    not merely when the state has come back."""
    seen: dict[str, list[int]] = field(default_factory=dict)
    states: list[str] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)
    predicted: Any = None
    """In ``check`` mode: the statistics the projection gave at the first recurrence."""

    def __post_init__(self) -> None:
        if self.occurrences < 2:
            raise ValueError(f"eval.cycle_stop must be 0 (off) or at least 2, got {self.occurrences}")

    def stop(self, state: str, stats: Any) -> bool:
        """Call at the start of each step with its textual state: True when the episode ends here,
        ``stats`` then extended as its remaining steps would have gone (:meth:`project`)."""
        if not self.recurs(state, stats):
            return False
        if not self.check:
            self.project(state, stats)
            return True
        if self.predicted is None:
            self.predicted = copy.deepcopy(stats)
            self.project(state, self.predicted)
        return False

    def finish(self, stats: Any) -> None:
        """At the episode's end, in ``check`` mode: ``stats.cycle_check`` compares what was played
        with what the projection said (None when no state recurred)."""
        if self.check and self.predicted is not None:
            at = self.predicted.steps - self.predicted.cycle_projected  # where the stop would have ended it
            stats.cycle_check = compare(self.predicted, stats, at)

    def recurs(self, state: str, stats: Any) -> bool:
        """True when ``state`` (the textual state of the step about to be played) has now occurred
        ``occurrences`` times in this episode."""
        if len(self.marks) != stats.steps:
            raise RuntimeError(f"cycle stop called at step {stats.steps} after {len(self.marks)} marks")
        self.marks.append(_mark(stats))
        self.states.append(state)
        steps = self.seen.setdefault(state, [])
        steps.append(stats.steps)
        if len(steps) < self.occurrences:
            return False
        return not self.repeated or self._same_cycles(steps[-self.occurrences :])

    def _same_cycles(self, at: list[int]) -> bool:
        """Whether the stretches of states between the occurrences at steps ``at`` are all the same."""
        first = self.states[at[0] : at[1]]
        return all(self.states[a:b] == first for a, b in zip(at[1:], at[2:]))

    def project(self, state: str, stats: Any) -> int:
        """Extend ``stats`` by the steps the episode would still have taken: those since ``state``'s
        previous occurrence, repeated in order up to the step cap. Returns how many were added."""
        start, now = self.seen[state][-2], stats.steps
        cycle = [(self.marks[i], self.marks[i + 1]) for i in range(start, now)]
        slices = {
            name: [getattr(stats, name)[a.lengths[k] : b.lengths[k]] for a, b in cycle]
            for k, name in enumerate(SEQUENCES)
        }
        remaining = max(0, self.max_steps - now)
        for j in range(remaining):
            i = j % len(cycle)
            before, after = cycle[i]
            for k, name in enumerate(COUNTERS):
                setattr(stats, name, getattr(stats, name) + after.counts[k] - before.counts[k])
            for name in SEQUENCES:
                getattr(stats, name).extend(copy.copy(x) for x in slices[name][i])
            for reason, n in after.gate_reasons.items():
                grown = n - before.gate_reasons.get(reason, 0)
                if grown:
                    stats.gate_reasons[reason] = stats.gate_reasons.get(reason, 0) + grown
            stats.reward += after.reward - before.reward
        stats.steps += remaining
        stats.cycle_projected = remaining
        return remaining


FIGURES = ("won", "steps", "loops", "reward", *COUNTERS)


OUTCOME = ("won", "steps", "reward")
"""The figures of an episode's outcome: what its success rate and mean steps are made of."""


def compare(predicted: Any, played: Any, at: int) -> dict[str, Any]:
    """What the projection made at step ``at`` got right about the played episode: ``exact`` when
    every figure (:data:`FIGURES`, the gate reasons, the Delta-F1 scores) agrees, ``outcome_exact``
    when those of :data:`OUTCOME` do; ``differ`` names those that do not; ``saved`` is the share of
    the episode's steps the stop would have skipped."""
    differ = [name for name in FIGURES if getattr(predicted, name) != getattr(played, name)]
    if predicted.gate_reasons != played.gate_reasons:
        differ.append("gate_reasons")
    if [round(x, 6) for x in predicted.delta_f1] != [round(x, 6) for x in played.delta_f1]:
        differ.append("delta_f1")
    return {
        "exact": not differ,
        "outcome_exact": not set(OUTCOME) & set(differ),
        "differ": differ,
        "at": at,
        "saved": 1 - at / max(1, played.steps),
    }
