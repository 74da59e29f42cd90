"""Wire protocol: message schemas, a msgpack codec with a schema version, and validation.

Messages are flat msgpack maps ``{"v": SCHEMA_VERSION, "type": <name>, ...fields}``. They stay
plain ``dict``s in memory (cheap to build, store and forward); the schema below says which fields
each type has, their wire types and size limits. :func:`decode` turns *any* input into either a
valid message or a :class:`ProtocolError` carrying the reason, so a server can reply and count
instead of dying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

ID_LEN = 256  # ids, names, game paths
TEXT_LEN = 64 * 1024  # observations, predictions, prompts
MAX_ITEMS = 4096  # list/map entries in one message

PHASES = ("warmup", "reflect_init", "coevolve")
DECISIONS = ("KEEP", "REVISE")
STORES = ("transitions", "reflections", "demos", "episodes")


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation; ``str()`` is the reason."""


@dataclass(frozen=True, slots=True)
class F:
    """One field of a message schema."""

    kind: str  # str | int | float | bool | map | list_map | list_str
    max_len: int = ID_LEN
    required: bool = True
    nullable: bool = False
    choices: tuple | None = None


_S, _T = F("str"), F("str", TEXT_LEN)
_I, _FL, _B = F("int"), F("float"), F("bool")
_OPT_T = F("str", TEXT_LEN, nullable=True)
_OPT_S = F("str", nullable=True)
_FACTS = F("list_str", max_len=MAX_ITEMS)
REFLECTION_LABELS = ("expert_better", "equal_draft", "not_better")
"""Why a reflection-initialisation sample got its label: ``y = 1`` only for ``expert_better``."""

SCHEMAS: dict[str, dict[str, F]] = {
    # actor -> broker: one environment step (DESIGN.md section 4). ``o`` is the raw observation at t
    # (``s`` is the rendered state with history); the world-state gate compares facts against it.
    "transition": {
        "seq": _I, "id": _S, "actor": _S, "env": _S, "game": _S, "split": _S, "episode": _S, "t": _I,
        "o": _T, "phase": F("str", choices=PHASES), "goal": _T, "s": _T, "a_draft": _T, "s_hat": _T,
        "decision": F("str", choices=DECISIONS), "a_ref": _T, "p_revise": _FL, "q_ref": _FL,
        "a_exec": _T, "s_hat_exec": _T, "s_hat_teacher": _T, "s_next": _T, "reward": _FL,
        "done": _B, "won": _B, "expert_action": _OPT_T, "policy_version": _I, "wm_version": _I,
        "ts": _FL,
        # canonical facts of the *state* before the action (C(s_t), DESIGN.md section 11): the
        # world-state gate applies each prediction to it
        "facts": _FACTS,
        # warm-up only: a non-expert action executed for the world model (no demonstration)
        "explore": F("bool", required=False),
    },
    # actor -> broker: end of an episode
    "episode": {
        "seq": _I, "id": _S, "actor": _S, "env": _S, "game": _S, "split": _S, "phase": F("str", choices=PHASES),
        "eval": _B, "steps": _I, "won": _B, "reward": _FL, "policy_version": _I, "wm_version": _I,
        "wall_s": _FL, "ts": _FL, "metrics": F("map", required=False),
    },
    # actor -> broker: a reflection sample labelled by suffix rollouts (reflect_init phase)
    "reflection": {
        "seq": _I, "id": _S, "actor": _S, "game": _S, "s": _T, "a_draft": _T, "s_bar": _T,
        "target": _T, "y": F("int", choices=(0, 1)), "policy_version": _I, "wm_version": _I, "ts": _FL,
        "label": F("str", choices=REFLECTION_LABELS),
    },
    # broker -> actor: stored (after commit) or refused
    # ``retry`` (on ok=False): true = temporary (storage refused; keep and resend later),
    # false = the message itself is bad (resending cannot help).
    "ack": {"seq": _I, "ok": _B, "error": _OPT_S, "registry": F("map"), "retry": F("bool", required=False)},
    # learner -> broker
    "sample": {"req": _I, "store": F("str", choices=STORES), "n": _I, "seed": F("int", nullable=True, required=False),
               # only items whose ``phase`` is one of these (transitions, reflections); absent: any
               "phases": F("list_str", max_len=len(PHASES), required=False)},
    "announce": {"req": _I, "phase": F("str", choices=PHASES), "versions": F("map"), "adapters": F("map"),
                 "step": _I, "metrics": F("map", required=False)},
    "get_registry": {"req": _I},
    # evaluator -> broker: held-out results of one adapter version (kept in the replay's meta)
    "eval_result": {"req": _I, "version": _I, "result": F("map")},
    "get_stats": {"req": _I},
    # broker -> learner
    "batch": {"req": _I, "store": F("str", choices=STORES), "items": F("list_map", max_len=MAX_ITEMS),
              "stale_skipped": _I, "available": _I},
    "reply": {"req": _I, "ok": _B, "error": _OPT_S, "data": F("map")},
}

# The registry every ack carries: which adapters are live and the phase.
REGISTRY_FIELDS = {"phase": str, "versions": dict, "adapters": dict, "step": int}


def empty_registry() -> dict[str, Any]:
    return {"phase": "warmup", "versions": {"policy": 0, "wm": 0, "wm_teacher": 0}, "adapters": {}, "step": 0}


def _check_value(name: str, spec: F, value: Any) -> None:
    if value is None:
        if spec.nullable:
            return
        raise ProtocolError(f"field '{name}' must not be null")
    kind = spec.kind
    if kind == "str":
        if type(value) is not str:
            raise ProtocolError(f"field '{name}' must be a string, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise ProtocolError(f"field '{name}' is {len(value)} characters, limit {spec.max_len}")
    elif kind == "int":
        if type(value) is not int:
            raise ProtocolError(f"field '{name}' must be an integer, got {type(value).__name__}")
        if not -(1 << 62) <= value <= (1 << 62):
            raise ProtocolError(f"field '{name}' is out of range")
    elif kind == "float":
        if type(value) not in (float, int):
            raise ProtocolError(f"field '{name}' must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ProtocolError(f"field '{name}' must be finite")
    elif kind == "bool":
        if type(value) is not bool:
            raise ProtocolError(f"field '{name}' must be a boolean, got {type(value).__name__}")
    elif kind == "map":
        if type(value) is not dict:
            raise ProtocolError(f"field '{name}' must be a map, got {type(value).__name__}")
        if len(value) > MAX_ITEMS:
            raise ProtocolError(f"field '{name}' has {len(value)} entries, limit {MAX_ITEMS}")
        for k in value:
            if type(k) is not str:
                raise ProtocolError(f"field '{name}' has a non-string key")
    elif kind in ("list_map", "list_str"):
        if type(value) is not list:
            raise ProtocolError(f"field '{name}' must be a list, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise ProtocolError(f"field '{name}' has {len(value)} items, limit {spec.max_len}")
        maps = kind == "list_map"
        for item in value:
            if (type(item) is not dict) if maps else (type(item) is not str or len(item) > ID_LEN):
                raise ProtocolError(f"field '{name}' items must be " +
                                    ("maps" if maps else f"strings of at most {ID_LEN} characters"))
        if not maps:
            return
    else:  # pragma: no cover - schema typo
        raise AssertionError(f"unknown field kind {kind}")
    if spec.choices is not None and value not in spec.choices:
        raise ProtocolError(f"field '{name}' must be one of {list(spec.choices)}, got {value!r}")


def validate(msg: Any) -> dict[str, Any]:
    """Check a decoded message against its schema; returns it unchanged or raises ProtocolError."""
    if type(msg) is not dict:
        raise ProtocolError(f"message must be a map, got {type(msg).__name__}")
    v = msg.get("v")
    if v != SCHEMA_VERSION or type(v) is not int:
        raise ProtocolError(f"unsupported schema version {v!r} (this side speaks v{SCHEMA_VERSION})")
    mtype = msg.get("type")
    schema = SCHEMAS.get(mtype) if type(mtype) is str else None
    if schema is None:
        raise ProtocolError(f"unknown message type {mtype!r}")
    if _FAST_CHECKS[mtype](msg):
        return msg
    # Something is wrong: the field-by-field walk finds the first problem and names it.
    for name, spec in schema.items():
        if name in msg:
            _check_value(name, spec, msg[name])
        elif spec.required:
            raise ProtocolError(f"{mtype}: missing field '{name}'")
    for k in msg:
        if k not in schema and k not in ("v", "type"):
            raise ProtocolError(f"{mtype}: unknown field {str(k)[:64]!r}")
    return msg


_MISSING = object()
_INT_BOUND = 1 << 62


def _fast_condition(var: str, spec: F, consts: dict[str, Any]) -> str:
    """A Python expression that is true iff ``_check_value`` would accept ``var`` for ``spec``."""
    kind = spec.kind
    if kind == "str":
        cond = f"type({var}) is str and len({var}) <= {spec.max_len}"
    elif kind == "int":
        cond = f"type({var}) is int and -_INT_BOUND <= {var} <= _INT_BOUND"
    elif kind == "float":
        # same call as the slow path, so a huge int behaves identically (OverflowError either way)
        cond = f"(type({var}) is float or type({var}) is int) and _isfinite({var})"
    elif kind == "bool":
        cond = f"type({var}) is bool"
    else:  # maps and lists are rare and small: reuse the exact slow check
        consts[f"spec_{var}"] = spec
        cond = f"_accepts(spec_{var}, {var})"
    if spec.choices is not None:
        consts[f"choices_{var}"] = spec.choices
        cond = f"({cond}) and {var} in choices_{var}"
    if spec.nullable:
        cond = f"{var} is None or ({cond})"
    return cond


def _accepts(spec: F, value: Any) -> bool:
    try:
        _check_value("", spec, value)
    except ProtocolError:
        return False
    return True


def _compile_check(mtype: str, schema: dict[str, F]) -> Any:
    """A straight-line acceptance test for one schema: no per-field function calls or spec lookups.

    It only answers "valid or not"; :func:`validate` walks the schema again to word the reason
    when it says no, so the fast path cannot change which messages pass or what a reject says.
    Counting the fields seen and comparing with ``len(msg)`` catches unknown keys without a loop.
    """
    consts: dict[str, Any] = {"_MISSING": _MISSING, "_INT_BOUND": _INT_BOUND, "_isfinite": math.isfinite,
                              "_accepts": _accepts}
    lines = [f"def check_{mtype}(msg):", "    get = msg.get", "    n = 2  # 'v' and 'type', checked by the caller"]
    for i, (name, spec) in enumerate(schema.items()):
        var = f"f{i}"
        lines.append(f"    {var} = get({name!r}, _MISSING)")
        cond = _fast_condition(var, spec, consts)
        if spec.required:
            lines += [f"    if {var} is _MISSING or not ({cond}):", "        return False", "    n += 1"]
        else:
            lines += [f"    if {var} is not _MISSING:", f"        if not ({cond}):", "            return False",
                      "        n += 1"]
    lines.append("    return len(msg) == n")
    exec(compile("\n".join(lines), f"<protocol check {mtype}>", "exec"), consts)  # noqa: S102 - our own schema
    return consts[f"check_{mtype}"]


_FAST_CHECKS = {mtype: _compile_check(mtype, schema) for mtype, schema in SCHEMAS.items()}


def make(mtype: str, **fields: Any) -> dict[str, Any]:
    """Build and validate a message of ``mtype``."""
    return validate({"v": SCHEMA_VERSION, "type": mtype, **fields})


def encode(msg: dict[str, Any], *, check: bool = True) -> bytes:
    """Serialise a message; validates it first unless ``check`` is False (already validated)."""
    if check:
        validate(msg)
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: Any, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Bytes from the wire -> a validated message. Anything else raises ProtocolError only."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"frame is {len(data)} bytes, limit {max_bytes}")
    if len(data) == 0:
        raise ProtocolError("empty frame")
    try:
        msg = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max_bytes, max_bin_len=0, max_array_len=MAX_ITEMS * 4, max_map_len=MAX_ITEMS * 4,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError...)
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {str(exc)[:120]}") from None
    return validate(msg)


def error_reason(exc: ProtocolError) -> str:
    """Short, single-line reason for replies and counters."""
    return str(exc).splitlines()[0][:200]
