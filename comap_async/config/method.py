"""The method's section: what changes the algorithm (the gates' thresholds, the losses' weights, the
ablations of the paper's study); every other section is tuning. The method package
(:mod:`comap_async.method`) reads the thresholds and the ablations; the learner the losses' weights."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, TypeAdapter

from comap_async.config.base import Section

AblationName = Literal[
    "frozen_wm",
    "no_wmsd",
    "no_real_ce",
    "no_ws_gate_real",
    "no_ws_gate_imagined",
    "no_action_gate",
    "no_future_state",
    "no_reflect_init",
    "no_expert_sft",
    "no_wm_warmup",
]
"""One ablation of the paper's study: each turns off exactly one mechanism of CoMap."""

ABLATIONS: dict[str, str] = {
    "frozen_wm": "the world model is not trained after warm-up, and its EMA teacher is frozen with it",
    "no_wmsd": "no world-model self-distillation: the KL term is dropped, the real-state CE kept",
    "no_real_ce": "self-distillation only: the world model's CE on real next states is dropped",
    "no_ws_gate_real": "no world-state gate, s̄ always the real next state",
    "no_ws_gate_imagined": "no world-state gate, s̄ always the world model's imagined state",
    "no_action_gate": "no action gate: the reflected action is executed whenever it differs from the draft (in "
    "the actors, and in the broker's reading of what was executed for the policy's samples)",
    "no_future_state": "the reflection prompt without the imagined state, in training and at inference (the "
    "world model still predicts and trains; the policy no longer sees its prediction)",
    "no_reflect_init": "warm-up goes straight to co-evolution (no reflection-mode initialisation)",
    "no_expert_sft": "no draft anchor: after warm-up the policy is not trained on expert demonstrations",
    "no_wm_warmup": "the world model is not trained during warm-up (the policy's warm-up SFT is kept)",
}
"""What each :data:`AblationName` turns off (``comap config --explain`` shows them with ``method.ablation``)."""


def _names(value: Any) -> Any:
    """``--set method.ablation=frozen_wm``: one name is a list of one. The mapping of switches that came
    before the list is refused (``config.REMOVED_FIELDS`` names the new form for each old key)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        raise ValueError(
            "a list of the ablations switched on (method.ablation: [frozen_wm]), not a mapping of switches"
        )
    return value


def _consistent(names: list[str]) -> list[str]:
    """The set of ``names``, sorted; refused when two of them contradict each other."""
    on = sorted(set(names))
    if {"no_wmsd", "no_real_ce"} <= set(on):
        raise ValueError(
            "no_wmsd and no_real_ce together leave the world model no loss; use frozen_wm for an untrained world model"
        )
    if {"no_ws_gate_real", "no_ws_gate_imagined"} <= set(on):
        raise ValueError(
            "no_ws_gate_real and no_ws_gate_imagined contradict each other: "
            "s̄ is either always the real or always the imagined state"
        )
    return on


Ablations = Annotated[list[AblationName], BeforeValidator(_names), AfterValidator(_consistent)]
"""The ablations switched on (``[]``: CoMap itself): a set, stored sorted, read by membership
(``"frozen_wm" in cfg.method.ablation``). Every process reads the same list; the learner records it in the run
directory (``ablation.json``) and with every published adapter version."""

_ABLATIONS = TypeAdapter(Ablations)


def ablations(names: Any) -> list[str]:
    """``names`` validated as the ``method.ablation`` field is (a run's recorded list, an experiment arm's):
    known names, none contradicting another, sorted without duplicates; ValidationError otherwise."""
    return _ABLATIONS.validate_python(names)


class MethodConfig(Section):
    tau_p: float = Field(default=0.5, ge=0.0, le=1.0)
    """Action gate: a revision is executed only if ``p_revise > tau_p``."""
    tau_q: float = Field(default=0.6, ge=0.0, le=1.0)
    """Action gate: ... and the refined action's confidence ``q_ref > tau_q``."""
    tau_ws: float = Field(default=0.6, ge=0.0, le=1.0)
    """World-state gate: the imagined state is used when student/teacher change-F1 >= tau_ws."""
    ablation: Ablations = Field(
        default_factory=list,
        description="The ablations of the paper's study switched on, a list of names (default []: CoMap itself), "
        "each turning off one mechanism: " + "; ".join(f"{name}: {what}" for name, what in ABLATIONS.items()),
    )
    eta: float = Field(default=0.5, ge=0.0)
    """Weight of the self-distillation KL in the world-model loss."""
    ema_momentum: float = Field(default=0.99, ge=0.0, le=1.0)
    """Teacher = m * teacher + (1 - m) * student after every optimizer step."""
    draft_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the draft cross-entropy on expert actions."""
    reflect_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the reflection cross-entropy."""
    bce_weight: float = Field(default=0.01, ge=0.0)
    """Weight of the BCE on the revise probability, in every phase (a lower weight for co-evolution alone,
    the paper's 0.01 there, shut the gate faster: docs/findings.md, "Under self-labelling the gate shuts
    itself")."""
    bce_gate_labels: bool = True
    """Whether the action gate's own decisions (the co-evolution samples' ``y``) train ``p`` through
    the BCE. False: only the suffix-labelled samples (reflection-mode initialisation's branch outcomes,
    mixed into co-evolution's reflection batches) do, and only they are counted for ``bce_balance``; the gate's
    samples still train the reflection's text. A label that is the gate's output teaches ``p`` its own
    threshold: a state whose ``p`` is under ``tau_p`` is labelled KEEP, which pulls ``p`` further
    down; with ``bce_balance`` weighing labels by the initialisation's REVISE-heavy counts the gate
    shut within one version (docs/findings.md, "Under self-labelling the gate shuts itself"). The paper
    trains on both
    (True)."""
    reflect_init_label: Literal["sooner", "paper"] = "sooner"
    """Which drafts reflection-mode initialisation labels REVISE (``y = 1``). ``sooner``: the expert's branch
    wins and the draft's does not (``expert_better``), or both win and the expert's in fewer steps
    (``expert_sooner``: the return read as discounted). ``paper``: the first alone, the paper's higher success
    rate (ALFWorld pays only at the win, so two winning branches tie on the undiscounted return) and a
    detour that still wins is kept (``not_better``). docs/design.md section 12 says why ``sooner`` is the
    default."""
    bce_balance: bool = False
    """Weigh the BCE's two labels alike (by the label counts the learner has trained on so far): a
    skewed mix is then not learned as a constant ``p``. Not in the paper (its BCE is unweighted)."""
