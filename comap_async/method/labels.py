"""What a branch comparison means, as the CoMap paper defines it (docs/design.md section 11): the
reflection-mode initialisation's label rule and the evaluation's URR, HRR and BRP.

Reflection-mode initialisation and the evaluation's reflection metrics both compare *branches*: from a
restored state, one rollout starts with one action and one with another, and both continue under the
same continuation policy (the game's expert) until the episode ends or the step limit. The rollouts
need an environment (``actors/branches.py``); what they are turned into is decided here, once, so it can
be checked on hand-built cases.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

EPS = 1e-8
"""The paper's ε in URR, HRR and BRP: a zero denominator gives 0 instead of a division error."""


class BranchResult(NamedTuple):
    won: bool
    """The branch reached the goal before the episode ended."""
    steps: int
    """Actions the branch took (its first action included)."""


def branch_outcome(won: bool, steps: int) -> BranchResult:
    return BranchResult(bool(won), int(steps))


def branch_better(a: BranchResult, b: BranchResult) -> bool:
    """``a`` does strictly better than ``b``: it wins and ``b`` does not, or both win and ``a`` in
    fewer steps (the larger discounted return, with the reward only at the win)."""
    if not a.won:
        return False
    return not b.won or a.steps < b.steps


def branch_sooner(a: BranchResult, b: BranchResult) -> bool:
    """``a`` is better than ``b`` by its step count alone: both win, ``a`` in fewer steps."""
    return a.won and b.won and a.steps < b.steps


def reflection_label(
    draft_equals_expert: bool, expert: BranchResult | None, draft: BranchResult | None, sooner: bool = True
) -> tuple[int, str]:
    """``(y, label)`` of a reflection-initialisation sample (docs/design.md section 11).

    ``y = 1`` (target: the expert action) only when the expert branch is strictly better than the
    draft branch (``expert_better``: it wins and the draft's does not; ``expert_sooner``: both win,
    the expert's in fewer steps, counted only with ``sooner``, ``method.reflect_init_label``); otherwise
    ``y = 0`` and the draft is kept. A draft canonically equal to the expert action is a keep sample
    (``equal_draft``): it teaches the policy not to over-correct."""
    if draft_equals_expert:
        return 0, "equal_draft"
    if expert is None or draft is None:
        raise ValueError("a draft that differs from the expert action needs both branch results")
    if branch_better(expert, draft):
        if not branch_sooner(expert, draft):
            return 1, "expert_better"
        if sooner:
            return 1, "expert_sooner"
    return 0, "not_better"


def reflection_diagnostics(steps: Iterable[tuple[int, int, int]], eps: float = EPS) -> dict[str, Any]:
    """URR, HRR and BRP over evaluated steps ``(m, z_draft, z_ref)`` (the paper's appendix C.2).

    ``m``: the action gate executed the reflected action; ``z_draft`` / ``z_ref``: the branch
    started by the draft / by the reflected action wins (``z_ref = z_draft`` when the two actions
    are canonically equal).

    * ``URR = Σ m·z_draft / (Σ z_draft + ε)``: over-intervention on drafts that would have won;
    * ``HRR = Σ m·z_draft·(1−z_ref) / (Σ z_draft + ε)``: revisions that turned a win into a loss;
    * ``BRP = Σ m·(1−z_draft)·z_ref / (Σ m + ε)``: executed revisions that turned a loss into a win.

    The raw sums come with the rates, so other definitions can be computed from them."""
    n = sum_m = sum_zd = m_zd = m_zd_not_zr = m_not_zd_zr = 0
    for m, zd, zr in steps:
        for name, v in (("m", m), ("z_draft", zd), ("z_ref", zr)):
            if v not in (0, 1):
                raise ValueError(f"{name} must be 0 or 1, got {v!r}")
        n += 1
        sum_m += m
        sum_zd += zd
        m_zd += m * zd
        m_zd_not_zr += m * zd * (1 - zr)
        m_not_zd_zr += m * (1 - zd) * zr
    return {
        "steps": n,
        "sum_m": sum_m,
        "sum_z_draft": sum_zd,
        "sum_m_z_draft": m_zd,
        "sum_m_z_draft_not_z_ref": m_zd_not_zr,
        "sum_m_not_z_draft_z_ref": m_not_zd_zr,
        "urr": m_zd / (sum_zd + eps),
        "hrr": m_zd_not_zr / (sum_zd + eps),
        "brp": m_not_zd_zr / (sum_m + eps),
    }
