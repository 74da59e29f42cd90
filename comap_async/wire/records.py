"""The kinds of record the broker stores and serves, told apart once from the fields the actors write:
the broker counts and samples by them, the learner builds its batches by them."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class RecordKind(enum.Enum):
    """What a record served under a store is, for the losses it trains (:func:`record_kind`)."""

    TRANSITION = "transition"
    """A real transition (store ``transitions``): the world model's CE on ``s_next`` given ``(s, a_exec)``,
    and self-distillation on the student's rollout ``s_hat_exec`` when it has one."""
    DEMO_STEP = "demo_step"
    """A demonstration in the window form (store ``demos``): one step's state ``s`` and expert action ``target``."""
    DEMO_PATH = "demo_path"
    """A demonstration in the turns form (``env.prompt_form``): a warm-up path, its ``turns`` and which of
    their actions are demonstrations (``targets``)."""
    GATE_REFLECTION = "gate_reflection"
    """A reflection sample whose decision label ``y`` is the action gate's (co-evolution)."""
    SUFFIX_REFLECTION = "suffix_reflection"
    """A reflection sample labelled by suffix rollouts during reflection-mode initialisation (``source: suffix``)."""


MICRO_BATCH_STORES = ("transitions", "demos", "reflections")
"""The keys of a micro-batch as the learner's prefetcher hands it to the trainer (imagined episodes
come under ``demos``)."""


def is_suffix_label(record: Mapping[str, Any]) -> bool:
    """A reflection sample labelled by suffix rollouts (reflection-mode initialisation), not by the gate."""
    return record.get("source") == "suffix"


def is_demo_path(record: Mapping[str, Any]) -> bool:
    """A demonstration in the turns form: a whole warm-up path, not one step."""
    return "turns" in record


def record_kind(store: str, record: Mapping[str, Any]) -> RecordKind:
    """The kind of ``record``, served under ``store`` of a micro-batch: the one place the forms and
    label sources are told apart by the fields the actors write (the wire format is unchanged)."""
    if store == "transitions":
        return RecordKind.TRANSITION
    if store == "demos":
        return RecordKind.DEMO_PATH if is_demo_path(record) else RecordKind.DEMO_STEP
    if store == "reflections":
        return RecordKind.SUFFIX_REFLECTION if is_suffix_label(record) else RecordKind.GATE_REFLECTION
    raise ValueError(f"a micro-batch holds no store {store!r} (it holds {', '.join(MICRO_BATCH_STORES)})")


def is_imagined(record: Mapping[str, Any]) -> bool:
    """Whether a demonstration comes from an imagined episode (``comap_async.method.phases.IMAGINED_DEMO_SHARE``):
    a path in the turns form marked ``imagined`` or one step of such an episode (``source: imagined``)."""
    return bool(record.get("imagined")) or record.get("source") == "imagined"
