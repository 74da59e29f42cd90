"""Validated actor messages -> the records the broker stores, with the gates applied (docs/design.md sections 4-5).

Per message type:

* ``transition`` in ``warmup``: the actor executed the expert's action (no LLM ran), so there is no
  reflection to learn from: the raw transition goes to ``transitions`` (world-model warm-up on
  real transitions) and ``(s, expert action)`` to ``demos``; an ``explore`` transition (a
  non-expert action, for the world model to see failures) goes to ``transitions`` only, and so does
  one with ``step_demo`` false (``env.draft_turns``: its demonstration comes as ``turn_demos``).
* ``turn_demos`` (``env.draft_turns``): to ``demos`` as one record, the path with its marked actions; an
  imagined episode's path (``imagined``) to ``imagined``.
* ``transition`` in ``reflect_init``/``coevolve``: the raw transition goes to ``transitions`` and
  the gated policy sample of :func:`comap_async.method.gates.derive_policy_sample` to ``reflections``;
  a transition whose reflection was unreadable (``reflection_readable`` false) derives no sample.
* ``reflection`` (suffix-labelled in ``reflect_init``): to ``reflections`` as sent.
* ``episode``: to ``episodes``.

The raw transition is stored as the exact bytes received; the derived sample keeps the gate
scores, so an analysis can recompute both gates with other thresholds later. The broker parses no
environment text: the world-state gate's reliability comes measured by the actor (``ws_score``).
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from broker.store import WriteItem
from comap_async.method.gates import SampleRule
from comap_async.wire.messages import (
    WARMUP,
    Demo,
    Episode,
    Imagined,
    Message,
    Reflection,
    Registry,
    Transition,
    TurnDemos,
)
from comap_async.wire.records import is_demo_path, is_suffix_label

ENVELOPE = ("v", "type", "seq")


def strip_envelope(msg: Message) -> dict[str, Any]:
    """A message's fields as a record (no ``v``, ``type`` or ``seq``)."""
    rec = msgspec.structs.asdict(msg)
    for k in ENVELOPE:
        rec.pop(k, None)
    return rec


class Ingest:
    """Turns validated actor messages into :class:`WriteItem`s (pure apart from counters)."""

    def __init__(self, rule: SampleRule | None = None) -> None:
        """``rule``: the gates' thresholds and ablations (:class:`~comap_async.method.gates.SampleRule`,
        from the config; the default is CoMap's)."""
        self.rule = rule or SampleRule()
        self._pack = msgspec.msgpack.Encoder().encode

    def prepare(self, msg: Message, raw: bytes) -> WriteItem:
        if type(msg) is Transition:
            return self._transition(msg, raw)
        if type(msg) is Reflection:
            rec = strip_envelope(msg)
            rec["source"] = "suffix"
            counters = {"stored_reflection_msgs": 1, f"reflect_label_{msg.label}": 1}
            return WriteItem(b"r:" + msg.id.encode(), [("reflections", self._pack(rec))], counters)
        if type(msg) is Imagined:  # the policy's draft data only: never a transition for the world model
            demo = Demo(
                id=msg.id,
                game=msg.game,
                goal=msg.goal,
                s=msg.s,
                target=msg.target,
                policy_version=msg.policy_version,
                wm_version=msg.wm_version,
                source="imagined",
                ts=msg.ts,
            )
            return WriteItem(b"i:" + msg.id.encode(), [("imagined", self._pack(demo))], {"stored_imagined": 1})
        if type(msg) is TurnDemos:  # stored as sent: the learner tells a path from a Demo by ``turns``
            rec = strip_envelope(msg)
            if msg.imagined:  # an imagined episode's path: the policy's draft data only, as an Imagined step
                return WriteItem(b"i:" + msg.id.encode(), [("imagined", self._pack(rec))], {"stored_imagined": 1})
            return WriteItem(b"d:" + msg.id.encode(), [("demos", self._pack(rec))], record_counters("demos", rec))
        if type(msg) is Episode:
            return WriteItem(
                b"e:" + msg.id.encode(), [("episodes", self._pack(strip_envelope(msg)))], {"stored_episodes": 1}
            )
        raise ValueError(f"not an actor message: {type(msg).__name__}")

    def _transition(self, tr: Transition, raw: bytes) -> WriteItem:
        key = b"t:" + tr.id.encode()
        if tr.phase == WARMUP:
            if tr.explore:
                # a non-expert action executed for the world model (it sees failures): no demonstration
                return WriteItem(key, [("transitions", raw)], {"stored_transitions": 1, "stored_explore": 1})
            if not tr.step_demo:  # its demonstration arrives in the episode's turn_demos
                return WriteItem(key, [("transitions", raw)], {"stored_transitions": 1})
            # warm-up executes the demonstration (a walkthrough or the expert), so a_exec is the target;
            # ``expert_action`` stays in the raw transition as the handcoded expert's own label
            demo = Demo(
                id=tr.id,
                game=tr.game,
                goal=tr.goal,
                s=tr.s,
                target=tr.a_exec,
                policy_version=tr.policy_version,
                wm_version=tr.wm_version,
                ts=tr.ts,
            )
            counters = {"stored_transitions": 1, "stored_demos": 1} | ({"stored_recovery": 1} if tr.recovery else {})
            return WriteItem(key, [("transitions", raw), ("demos", self._pack(demo))], counters)
        if not tr.reflection_readable:
            # the policy's reflection could not be read: nothing it said may train it (the draft ran)
            return WriteItem(
                key, [("transitions", raw)], {"stored_transitions": 1, "gate_ag_total": 1, "gate_ag_unreadable": 1}
            )
        sample = self.rule.derive(tr)
        counters = {
            "stored_transitions": 1,
            "stored_derived": 1,
            "gate_ws_total": 1,
            "gate_ws_imagined": int(sample.ws_imagined),
            "gate_ag_total": 1,
            "gate_ag_open": sample.y,
            f"gate_ag_{sample.ag_reason}": 1,
        }
        if tr.ws_score is None:  # an actor that measured no reliability: the real future, and counted
            counters["gate_ws_unscored"] = 1
        return WriteItem(key, [("transitions", raw), ("reflections", self._pack(sample))], counters)


def record_counters(store: str, rec: dict[str, Any]) -> dict[str, int]:
    """The counters one stored record stands for: over the records :meth:`Ingest.prepare` writes for a
    message they sum to its counters (``tests/unit/test_ingest_counters.py``), so a fork that cuts
    records can take their counts back out (``ReplayStore.cut_after``'s ``uncount``)."""
    if store == "transitions":
        out = {"stored_transitions": 1}
        if rec.get("phase") == WARMUP:
            if rec.get("explore"):
                return out | {"stored_explore": 1}
            if not rec.get("step_demo", True):
                return out
            return out | {"stored_demos": 1} | ({"stored_recovery": 1} if rec.get("recovery") else {})
        if not rec.get("reflection_readable", True):
            return out | {"gate_ag_total": 1, "gate_ag_unreadable": 1}
        return out | ({"gate_ws_unscored": 1} if rec.get("ws_score") is None else {})
    if store == "reflections":
        if is_suffix_label(rec):
            return {"stored_reflection_msgs": 1, f"reflect_label_{rec['label']}": 1}
        return {
            "stored_derived": 1,
            "gate_ws_total": 1,
            "gate_ws_imagined": int(rec["ws_imagined"]),
            "gate_ag_total": 1,
            "gate_ag_open": int(rec["y"]),
            f"gate_ag_{rec['ag_reason']}": 1,
        }
    if store == "imagined":
        return {"stored_imagined": 1}
    if store == "episodes":
        return {"stored_episodes": 1}
    if store == "demos" and is_demo_path(rec):
        return {"stored_turn_demos": 1, "stored_demo_turns": sum(rec["targets"])}
    return {}  # demos: counted with their warm-up transition


def record_from_store(store: str, value: bytes) -> dict[str, Any]:
    """A stored value -> the item served to learners (raw transitions lose their wire envelope)."""
    rec = msgpack.unpackb(value, raw=False)
    if store == "transitions":
        for k in ENVELOPE:
            rec.pop(k, None)
    return rec


def best_effort_int(raw: Any, field: str) -> int:
    """The ``seq``/``req`` of a message that failed validation, so the sender can match the error."""
    try:
        # binaries, extension types and array keys read too (the frame's size bounds them): a message
        # refused for one of them must still be answered with its seq, or its sender resends it forever
        n = len(raw)
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=False, max_bin_len=n, max_ext_len=n)
        value = obj.get(field) if isinstance(obj, dict) else None
        return value if type(value) is int and abs(value) <= (1 << 62) else -1
    except Exception:  # any garbage: there is no number to echo
        return -1


def checked_registry(msg: Any) -> dict[str, Any]:
    """The registry (its map) an ``announce`` sets, after the checks of :class:`Registry` (ValueError)."""
    try:
        reg = msgspec.convert(
            {"phase": msg.phase, "versions": msg.versions, "adapters": msg.adapters, "step": msg.step}, Registry
        )
    except msgspec.ValidationError as exc:
        raise ValueError(f"announce: {exc}") from None
    return msgspec.to_builtins(reg)
