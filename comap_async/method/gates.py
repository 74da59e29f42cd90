"""The two CoMap gates and the policy sample they derive (pure functions, docs/design.md sections 1, 5).

* The **action gate** decides whether the reflected action ``a_ref`` is executed instead of the
  draft: only a confident, real revision passes.
* The **world-state gate** decides whether the policy's reflection sample may show the world
  model's imagined next state ``ŝ`` or must show the real ``s'``: the changes the student's and
  the EMA teacher's predictions make to the state's facts must agree (a reliability score, the
  F1 between them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from comap_async.facts import Facts, NextState, changes_f1, set_f1
from comap_async.wire.messages import PolicySample, Transition

_SPACES = re.compile(r"\s+")
_TRAILING = re.compile(r"[\s.!?;:,\"'`]+$")


def action_verb(action: str) -> str:
    """An action's first word, lower case (``go``, ``take``, ``move``); empty for an empty action."""
    words = action.split(maxsplit=1)
    return words[0].lower() if words else ""


def canonical_action(action: str) -> str:
    """Lower case, single spaces, no surrounding quotes or trailing punctuation."""
    a = _SPACES.sub(" ", action.strip().strip("\"'`")).lower()
    return _TRAILING.sub("", a)


class ActionGateResult(NamedTuple):
    open: bool
    """True: execute ``a_ref``; False: execute ``a_draft``."""
    reason: str
    """Which condition decided (for counters and analysis)."""


def action_gate(
    p_revise: float,
    q_ref: float,
    a_ref: str,
    a_draft: str,
    tau_p: float = 0.5,
    tau_q: float = 0.6,
    canon: Callable[[str], str] = canonical_action,
) -> ActionGateResult:
    """Execute the refinement iff ``p_revise > tau_p``, ``q_ref > tau_q`` and it is a different action."""
    if not p_revise > tau_p:
        return ActionGateResult(False, "keep")
    if not q_ref > tau_q:
        return ActionGateResult(False, "low_confidence")
    if not a_ref.strip() or canon(a_ref) == canon(a_draft):
        return ActionGateResult(False, "same_action")
    return ActionGateResult(True, "revised")


def ungated_action(a_ref: str, a_draft: str, canon: Callable[[str], str] = canonical_action) -> ActionGateResult:
    """The ablation ``no_action_gate``: the reflected action is executed whenever it is a real,
    different action, whatever ``p_revise`` and ``q_ref`` say."""
    if not a_ref.strip() or canon(a_ref) == canon(a_draft):
        return ActionGateResult(False, "same_action")
    return ActionGateResult(True, "revised")


class WorldStateGateResult(NamedTuple):
    use_imagined: bool
    """True: the reflection sample shows the student's imagined state."""
    score: float
    """Reliability: F1 between the student's and the teacher's predicted fact changes."""


def world_state_gate(
    student_delta: frozenset[str] | None, teacher_delta: frozenset[str] | None, threshold: float = 0.6
) -> WorldStateGateResult:
    """Agreement of student and teacher predicted changes; an unparseable side never passes."""
    if student_delta is None or teacher_delta is None:
        return WorldStateGateResult(False, 0.0)
    score = set_f1(student_delta, teacher_delta)
    return WorldStateGateResult(score >= threshold, score)


def world_state_gate_on_facts(
    prev: Facts | None, student: Facts | None, teacher: Facts | None, threshold: float = 0.6
) -> WorldStateGateResult:
    """:func:`world_state_gate` on the changes from the state ``prev`` to each predicted state,
    computed by :func:`~comap_async.facts.changes_f1` (same scores, without building the change sets)."""
    if prev is None or student is None or teacher is None:
        return WorldStateGateResult(False, 0.0)
    score = changes_f1(prev, student, teacher)
    return WorldStateGateResult(score >= threshold, score)


def future_context(tr: Transition, use_imagined: bool, canon: Callable[[str], str] = canonical_action) -> str:
    """``s̄``, the future the reflection sample shows next to the draft (docs/design.md section 5).

    It always describes the **draft**, as ``ŝ = WM(s, a_draft)`` does at inference, and the
    world-state gate chooses between the imagined and the real future on every step: when it
    trusts the student, the student's prediction for the draft (``s_hat_exec`` on a step that
    executed the draft, ``s_hat`` on a revised one); else the draft's real next state (``s_next``,
    or on a revised step ``s_next_draft``, which the actor took on a branch). A revised step
    without ``s_next_draft`` (its branch could not be restored) shows the imagined state."""
    if canon(tr.a_exec) != canon(tr.a_draft):
        return tr.s_hat if use_imagined or tr.s_next_draft is None else tr.s_next_draft
    return tr.s_hat_exec if use_imagined else tr.s_next


def world_state_score(next_state: NextState, before: Facts, student: str, teacher: str) -> float:
    """The world-state gate's reliability for one executed action: the F1 between the fact changes
    the student's and the teacher's predictions make to the state before it (docs/design.md
    section 11). An unreadable prediction scores 0; the same text, once readable, scores 1 without
    building its changes. The actor computes it (it holds the environment's fact state); the
    threshold is applied where the sample is derived (:func:`derive_policy_sample`)."""
    if student == teacher:  # ``is_readable`` (optional): readable without building the facts
        readable = getattr(next_state, "is_readable", None)
        ok = readable(student) if readable is not None else next_state(before, student) is not None
        return 1.0 if ok else 0.0
    return world_state_gate_on_facts(before, next_state(before, student), next_state(before, teacher)).score


def derive_policy_sample(
    tr: Transition,
    tau_p: float = 0.5,
    tau_q: float = 0.6,
    tau_ws: float = 0.6,
    canon: Callable[[str], str] = canonical_action,
    future_state: str = "gate",
    action_gated: bool = True,
) -> PolicySample:
    """The policy reflection sample ``(s, a_draft, s̄, target, y)`` for one stored transition.

    The world-state gate trusts the imagined state when the actor's reliability score
    (``tr.ws_score``, :func:`world_state_score`) is at least ``tau_ws``; a transition without one is
    never trusted. ``s̄`` is :func:`future_context`; ``target = a_exec`` and ``y = 1`` when the
    action gate executed the revision, else ``a_draft`` and ``y = 0``. Gate inputs and scores are
    kept so an analysis can recompute them with other thresholds.

    ``future_state`` (the ablations ``no_ws_gate_real`` / ``no_ws_gate_imagined``): ``real`` or
    ``imagined`` replace the gate's choice of ``s̄`` (its score is still kept);
    ``action_gated=False`` (``no_action_gate``) reads the executed choice as :func:`ungated_action`.
    """
    if future_state not in ("gate", "real", "imagined"):
        raise ValueError(f"future_state must be 'gate', 'real' or 'imagined', got {future_state!r}")
    score = 0.0 if tr.ws_score is None else tr.ws_score
    ws = WorldStateGateResult(tr.ws_score is not None and score >= tau_ws, score)
    if action_gated:
        ag = action_gate(tr.p_revise, tr.q_ref, tr.a_ref, tr.a_draft, tau_p, tau_q, canon)
    else:
        ag = ungated_action(tr.a_ref, tr.a_draft, canon)
    use_imagined = ws.use_imagined if future_state == "gate" else future_state == "imagined"
    return PolicySample(
        id=tr.id,
        game=tr.game,
        s=tr.s,
        a_draft=tr.a_draft,
        s_bar=future_context(tr, use_imagined, canon),
        target=tr.a_ref if ag.open else tr.a_draft,
        y=1 if ag.open else 0,
        ws_score=ws.score,
        ws_imagined=ws.use_imagined,
        ag_reason=ag.reason,
        policy_version=tr.policy_version,
        wm_version=tr.wm_version,
        phase=tr.phase,
        draft_confidence=tr.draft_confidence,
        dialogue=tr.dialogue,
        ts=tr.ts,
    )


@dataclass(frozen=True)
class SampleRule:
    """Everything that decides a co-evolution transition's reflection sample, read from the config
    once: the thresholds and the ablations that change the gates (the broker applies it to the
    scores the actor measured; its gate workers get it whole)."""

    tau_p: float = 0.5
    tau_q: float = 0.6
    tau_ws: float = 0.6
    future_state: str = "gate"
    """``gate`` (CoMap: the world-state gate chooses ``s̄``), ``real`` or ``imagined`` (its ablations)."""
    action_gated: bool = True
    """False under ``no_action_gate``: any different reflected action counts as executed."""

    @classmethod
    def from_config(cls, cfg: Any) -> "SampleRule":
        g, a = cfg.method, cfg.method.ablation
        future = "real" if "no_ws_gate_real" in a else "imagined" if "no_ws_gate_imagined" in a else "gate"
        return cls(g.tau_p, g.tau_q, g.tau_ws, future, "no_action_gate" not in a)

    def derive(self, tr: Transition) -> PolicySample:
        return derive_policy_sample(
            tr, self.tau_p, self.tau_q, self.tau_ws, future_state=self.future_state, action_gated=self.action_gated
        )


def gate_reflection(cfg: Any, refl: Any, a_draft: str) -> ActionGateResult:
    """The actor's action gate on one reflection (``actors.llm.Reflected``): closed when it could not
    be read; under the ablation ``no_action_gate`` open for any different action; else CoMap's gate."""
    if not refl.readable:
        return ActionGateResult(False, "unreadable")
    if "no_action_gate" in cfg.method.ablation:
        return ungated_action(refl.a_ref, a_draft)
    return action_gate(refl.p_revise, refl.q_ref, refl.a_ref, a_draft, cfg.method.tau_p, cfg.method.tau_q)


def decision_first(cfg: Any, evaluating: bool) -> float | None:
    """The ``p_revise`` at or below which an evaluation's reflection is not generated past its decision
    token: CoMap's gate keeps the draft there whatever follows, so the episode is the one the whole
    reflection gives and the server decodes fewer tokens (a CoMap step 2.7 against 3.3 s, docs/running.md).
    None (generate it whole) in co-evolution, whose transitions carry the reflection's own action and
    readability, and under ``no_action_gate``, whose gate reads every reflection's action."""
    if not evaluating or "no_action_gate" in cfg.method.ablation:
        return None
    return cfg.method.tau_p
