"""Wire codec: messages (:mod:`comap_async.wire.messages`) <-> msgpack bytes, with validation.

:func:`decode` turns *any* input into either a valid message or a :class:`ProtocolError` carrying
the reason, so a server can reply and count instead of dying. msgspec decodes and validates in
one pass; only a rejected frame is looked at again, to word its reason the way operators know
(the version first, then the type, then the first bad field).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec
import msgspec.inspect

from comap_async.wire.messages import (  # noqa: F401 - re-exported: the codec's users name them from here
    ACTOR_TYPES,
    DEFAULT_MAX_MESSAGE_BYTES,
    ID_LEN,
    MAX_ITEMS,
    PHASES,
    REFLECTION_LABELS,
    SCHEMA_VERSION,
    STORES,
    TEXT_LEN,
    AnyMessage,
    Message,
    Registry,
)

_TYPES: dict[str, type[Message]] = {cls.__struct_config__.tag: cls for cls in AnyMessage.__args__}
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_encoder = msgspec.msgpack.Encoder()


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation; ``str()`` is the reason."""


def message_type(msg: Message) -> str:
    """The wire ``type`` of a message (its tag)."""
    return msg.__struct_config__.tag


def empty_registry() -> dict[str, Any]:
    """The registry before any publish, as the map the broker keeps and persists."""
    return msgspec.to_builtins(Registry())


def make(mtype: str, **fields: Any) -> Message:
    """Build and validate a message of ``mtype`` from its fields."""
    return validate({"v": SCHEMA_VERSION, "type": mtype, **fields})


def validate(obj: Any) -> Message:
    """A wire map (or a message) -> a validated message, or ProtocolError naming the first problem."""
    if isinstance(obj, Message):
        obj = as_map(obj)
    try:
        return msgspec.convert(obj, AnyMessage)
    except msgspec.ValidationError as exc:
        raise _reason(obj, exc) from None


def as_map(msg: Message) -> dict[str, Any]:
    """The message as the plain map it is on the wire (``type`` and ``v`` included)."""
    return msgspec.to_builtins(msg)


def encode(msg: Message | dict[str, Any], *, check: bool = True) -> bytes:
    """Serialise a message (or a wire map); validated unless ``check`` is False (already valid).

    A ``Struct`` is not validated when built, so checking means reading the bytes back."""
    if isinstance(msg, dict):
        msg = validate(msg)
        check = False
    data = _encoder.encode(msg)
    if check:
        decode(data, max(DEFAULT_MAX_MESSAGE_BYTES, len(data)))
    return data


def decode(data: Any, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Bytes from the wire -> a validated message. Anything else raises ProtocolError only."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"frame is {len(data)} bytes, limit {max_bytes}")
    if len(data) == 0:
        raise ProtocolError("empty frame")
    try:
        msg = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _reason(_loose(data, max_bytes), exc) from None
    except Exception as exc:  # malformed msgpack, trailing bytes, nesting too deep...
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {str(exc)[:120]}") from None
    maps = _FREE_MAPS.get(type(msg))
    if maps:
        for name in maps:
            _check_plain(name, getattr(msg, name))
    return msg


def error_reason(exc: ProtocolError) -> str:
    """Short, single-line reason for replies and counters."""
    return str(exc).splitlines()[0][:200]


# Free-form maps a peer fills (an actor's episode metrics, an announce, an eval result): msgpack
# binaries and extension types would decode, then break every JSON view of them (``/stats``).
_FREE_MAPS = {
    cls: [f.name for f in msgspec.structs.fields(cls) if f.name in ("metrics", "versions", "adapters", "result")]
    for cls in AnyMessage.__args__
}
_PLAIN = (str, int, float, bool, type(None))


def _check_plain(name: str, value: Any, depth: int = 0) -> None:
    if type(value) in _PLAIN:
        return
    if depth < 8 and type(value) is dict:
        for v in value.values():
            _check_plain(name, v, depth + 1)
        return
    if depth < 8 and type(value) is list:
        for v in value:
            _check_plain(name, v, depth + 1)
        return
    raise ProtocolError(
        f"field '{name}' holds {type(value).__name__} values (only strings, numbers, booleans, "
        "lists and maps, 8 levels deep)"
    )


# ---- reasons -----------------------------------------------------------------------------------


def _loose(data: Any, max_bytes: int) -> Any:
    """The frame as plain msgpack (it is well-formed: msgspec read it), to word a rejection."""
    try:
        return msgpack.unpackb(  # arrays as tuples: an array used as a map key must hash to be worded
            data,
            raw=False,
            strict_map_key=False,
            use_list=False,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_ext_len=0,
        )
    except Exception:  # noqa: BLE001 - e.g. a key msgpack-python will not hash; the generic reason serves
        return None


def _reason(obj: Any, exc: msgspec.ValidationError) -> ProtocolError:
    """The operator-facing reason a well-formed message was refused (schema version first)."""
    if type(obj) is not dict:
        return ProtocolError(f"message must be a map, got {type(obj).__name__}")
    v = obj.get("v")
    if type(v) is not int or v != SCHEMA_VERSION:
        return ProtocolError(f"unsupported schema version {v!r} (this side speaks v{SCHEMA_VERSION})")
    mtype = obj.get("type")
    cls = _TYPES.get(mtype) if type(mtype) is str else None
    if cls is None:
        return ProtocolError(f"unknown message type {mtype!r}")
    text = str(exc)
    detail, _, where = text.partition(" - at `key` in `$.")
    value = obj.get(where.rstrip("`")) if where and detail.startswith("Expected `str`") else None
    bad = [k for k in value if type(k) is not str][:1] if type(value) is dict else []
    if bad:  # a top-level key of a free-form map, worded as messages._finite words nested ones
        return ProtocolError(
            f"{mtype}: {where.rstrip('`')}.{str(bad[0])[:40]}: map keys must be strings, got {type(bad[0]).__name__}"
        )
    detail, _, path = text.partition(" - at `$.")
    field = path.rstrip("`").split("[")[0].split(".")[0] if path else ""
    if detail.startswith("Object missing required field `"):
        return ProtocolError(f"{mtype}: missing field '{detail.split('`')[1]}'")
    if detail.startswith("Object contains unknown field `"):
        return ProtocolError(f"{mtype}: unknown field {detail.split('`')[1][:64]!r}")
    if not field:
        return ProtocolError(f"{mtype}: {text[:200]}")
    value = obj.get(field)
    if type(value) is float and not math.isfinite(value):
        return ProtocolError(f"field '{field}' must be finite")
    if detail.startswith("Invalid enum value"):
        choices = msgspec.inspect.type_info(cls)
        allowed = next(
            (list(f.type.values) for f in choices.fields if f.name == field and hasattr(f.type, "values")), None
        )
        return ProtocolError(
            f"field '{field}' must be one of {allowed}, got {value!r}"
            if allowed
            else f"field '{field}' must be one of the allowed values, got {value!r}"
        )
    if "length <=" in detail:
        return ProtocolError(f"field '{field}' is over its limit: {detail}")
    return ProtocolError(f"field '{field}': {detail}")
