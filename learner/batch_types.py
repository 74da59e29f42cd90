"""The learner's batches, one type per kind, built once from the records of a micro-batch.

The broker serves records by store name (``transitions``, ``demos``, ``reflections``); :func:`micro_batch`
reads them (:func:`learner.batches.record_kind` decides each one's kind) and encodes them
(:class:`learner.batches.Encoder`) into:

* :class:`WorldModelBatch`: real transitions, per unit the world model's sequences over one prompt (a
  CE target on the real next state, the student's rollout) and the EMA teacher's sequence over that
  rollout (self-distillation's target);
* :class:`DraftBatch`: demonstrations, a step's expert action (window form) or a warm-up path (turns form);
* :class:`ReflectionBatch`: reflection samples with their decision label ``y``, where it came from (the
  gate, or suffix rollouts in reflection-mode initialisation), whether it trains ``p`` and its BCE weight.

The trainer packs these into rows chunk by chunk (:func:`learner.packing.pack`); the losses are
:mod:`learner.losses`' terms, composed once (:func:`learner.losses.step_loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from comap_async.wire.records import RecordKind, is_imagined, record_kind
from learner.batches import Encoder, Seq
from learner.packing import unit_length

Records = Mapping[str, list[dict[str, Any]]]
"""A micro-batch as the broker serves it: records by store name."""


@dataclass
class WorldModelUnit:
    """One prompt ``(s, a_exec)`` and the world model's targets that continue it (packed as one unit)."""

    seqs: list[Seq]
    is_ce: list[bool]
    """Per sequence: a CE target on the real next state (True) or the student's rollout (False)."""
    teacher: Seq | None = None
    """The EMA teacher's sequence over the rollout (its prompt also shows ``s_next``); None: no rollout."""

    @property
    def length(self) -> int:
        """Positions the unit takes in a packed row."""
        return unit_length(self.seqs)


@dataclass
class WorldModelBatch:
    """Real transitions for the world model: CE on ``s_next`` and self-distillation on ``s_hat_exec``."""

    units: list[WorldModelUnit] = field(default_factory=list)

    @property
    def n_ce(self) -> int:
        """Target tokens of the CE term (its mean's count)."""
        return sum(s.n_target for u in self.units for s, ce in zip(u.seqs, u.is_ce) if ce)

    @property
    def n_kl(self) -> int:
        """Rollout tokens of the self-distillation term (its mean's count)."""
        return sum(s.n_target for u in self.units for s, ce in zip(u.seqs, u.is_ce) if not ce)


@dataclass
class DraftBatch:
    """Demonstrations for the policy's draft CE: the ones whose sequence carries a loss (a warm-up path
    none of whose demonstrated actions fits ``inference.max_prompt_tokens`` carries none and is left out;
    it is counted in ``learner/truncated``)."""

    seqs: list[Seq] = field(default_factory=list)
    kinds: list[RecordKind] = field(default_factory=list)
    """Per sequence: :attr:`RecordKind.DEMO_STEP` (window form) or :attr:`RecordKind.DEMO_PATH` (turns form)."""
    records: int = 0
    """How many demonstrations the micro-batch held, those left out too (a micro-batch that held any
    logs the policy's terms, 0 when none carried a loss)."""
    imagined: int = 0
    """How many of them were imagined episodes' (``policy/imagined_demos``)."""

    @property
    def n_loss(self) -> int:
        return sum(s.n_loss for s in self.seqs)


@dataclass
class ReflectionBatch:
    """Reflection samples for the policy's reflection CE and the BCE on ``p``."""

    seqs: list[Seq] = field(default_factory=list)
    y: list[int] = field(default_factory=list)
    """The decision label: 1 REVISE, 0 KEEP."""
    kinds: list[RecordKind] = field(default_factory=list)
    """Where ``y`` came from: :attr:`RecordKind.GATE_REFLECTION` or :attr:`RecordKind.SUFFIX_REFLECTION`."""
    in_bce: list[bool] = field(default_factory=list)
    """Whether the sample's ``y`` trains ``p`` (``method.bce_gate_labels``: the gate's labels may not)."""
    weight: list[float] | None = None
    """Per sample, its BCE weight under ``method.bce_balance`` (None: unweighted); set by the trainer
    from the labels it has trained on (:meth:`learner.trainer.Trainer.weigh`)."""

    @property
    def n_loss(self) -> int:
        return sum(s.n_loss for s in self.seqs)

    @property
    def n_bce(self) -> int:
        return sum(self.in_bce)

    def label_counts(self) -> list[int]:
        """How many of the samples that train ``p`` have y = 0 and y = 1."""
        counts = [0, 0]
        for y, labelled in zip(self.y, self.in_bce):
            counts[y] += labelled
        return counts


@dataclass(frozen=True)
class PolicySample:
    """One sequence of the policy's pass: a demonstration (``y`` None) or a reflection sample."""

    seq: Seq
    y: int | None = None
    in_bce: bool = False
    weight: float | None = None

    @property
    def length(self) -> int:
        return len(self.seq.ids)


@dataclass
class MicroBatch:
    """A micro-batch's typed batches, and its transitions as served (PaW reads them under the policy:
    learner/paw.py)."""

    world_model: WorldModelBatch = field(default_factory=WorldModelBatch)
    drafts: DraftBatch = field(default_factory=DraftBatch)
    reflections: ReflectionBatch = field(default_factory=ReflectionBatch)
    transitions: list[dict[str, Any]] = field(default_factory=list)

    def policy_samples(self) -> list[PolicySample]:
        """The policy's sequences in one list: the demonstrations, then the reflection samples."""
        return policy_samples(self.drafts, self.reflections)


def policy_samples(drafts: DraftBatch, reflections: ReflectionBatch) -> list[PolicySample]:
    """The demonstrations, then the reflection samples, as the policy's pass takes them."""
    r = reflections
    weights = r.weight if r.weight is not None else [None] * len(r.seqs)
    return [PolicySample(seq) for seq in drafts.seqs] + [
        PolicySample(seq, y, labelled, w) for seq, y, labelled, w in zip(r.seqs, r.y, r.in_bce, weights)
    ]


def world_model_batch(encoder: Encoder, records: list[dict[str, Any]], real_ce: bool, distill: bool) -> WorldModelBatch:
    """Per transition, its unit(s): the CE target (``real_ce``) and the rollout (``distill``) share one
    pass over their prompt, unless the two prompts were truncated differently."""
    units: list[WorldModelUnit] = []
    for r in records:
        ce_seq = encoder.world_model_ce(r) if real_ce else None
        pair = encoder.world_model_rollout(r) if distill else None
        if ce_seq is None:
            if pair is not None:
                units.append(WorldModelUnit([pair[0]], [False], pair[1]))
        elif pair is None:
            units.append(WorldModelUnit([ce_seq], [True]))
        elif pair[0].ids[: pair[0].start] == ce_seq.ids[: ce_seq.start]:
            units.append(WorldModelUnit([ce_seq, pair[0]], [True, False], pair[1]))  # one pass over the prompt
        else:  # a prompt truncated differently for the two targets
            units += [WorldModelUnit([ce_seq], [True]), WorldModelUnit([pair[0]], [False], pair[1])]
    return WorldModelBatch(units)


def draft_batch(encoder: Encoder, records: list[dict[str, Any]]) -> DraftBatch:
    """The demonstrations' sequences (window or turns form) that carry a loss."""
    batch = DraftBatch(records=len(records), imagined=sum(map(is_imagined, records)))
    for r in records:
        seq = encoder.draft(r)
        if seq.n_loss:
            batch.seqs.append(seq)
            batch.kinds.append(record_kind("demos", r))
    return batch


def reflection_batch(encoder: Encoder, records: list[dict[str, Any]], bce_gate_labels: bool) -> ReflectionBatch:
    """The reflection samples' sequences and labels; a gate's label trains ``p`` only under
    ``method.bce_gate_labels``, a suffix-labelled one always."""
    batch = ReflectionBatch()
    for r in records:
        kind = record_kind("reflections", r)
        batch.seqs.append(encoder.reflection(r))
        batch.y.append(int(r["y"]))
        batch.kinds.append(kind)
        batch.in_bce.append(bce_gate_labels or kind is RecordKind.SUFFIX_REFLECTION)
    return batch


def micro_batch(
    encoder: Encoder,
    records: Records,
    *,
    real_ce: bool = True,
    distill: bool = True,
    bce_gate_labels: bool = True,
    train_world_model: bool = True,
) -> MicroBatch:
    """A served micro-batch's typed batches (``real_ce``/``distill``: the world-model terms an ablation
    keeps, :func:`comap_async.method.routing.world_model_terms`; ``train_world_model`` False: its
    transitions train no world model, the ablation ``frozen_wm``)."""
    transitions = list(records.get("transitions") or [])
    return MicroBatch(
        world_model=world_model_batch(encoder, transitions, real_ce, distill)
        if train_world_model
        else WorldModelBatch(),
        drafts=draft_batch(encoder, list(records.get("demos") or [])),
        reflections=reflection_batch(encoder, list(records.get("reflections") or []), bce_gate_labels),
        transitions=transitions,
    )
