"""The run's status as plain JSON: one converter from the Status RPC's message, used by ``dtrain status --json`` and
the coordinator's dashboard endpoint alike, so both print the same document.

Protobuf's own JSON mapping writes 64-bit integers as strings and leaves out fields at their default; operators'
tools (``jq``, a dashboard's JavaScript) want numbers as numbers and every field present. So: integers as JSON
numbers, every field present, an unset ``optional`` field as ``null``, non-finite floats as ``"nan"``/``"inf"``/
``"-inf"`` (strict JSON has no literal for them, :func:`dtrain.runlog.json_number`), enums by name, maps as
objects.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from dtrain.runlog import json_number


def message_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (recursively) as plain JSON values, named as in the proto file."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        if f.has_presence and not f.is_repeated and not msg.HasField(f.name):
            out[f.name] = None
            continue
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:  # a map: a JSON object
            entry = f.message_type.fields_by_name["value"]
            out[f.name] = {str(k): _value(entry, v) for k, v in sorted(value.items())}
        elif f.is_repeated:
            out[f.name] = [_value(f, v) for v in value]
        else:
            out[f.name] = _value(f, value)
    return out


def _value(f: Any, v: Any) -> Any:  # Any: the descriptor is upb's or the pure-Python one
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return message_dict(v)
    if f.type == FieldDescriptor.TYPE_ENUM:
        known = f.enum_type.values_by_number
        return known[v].name if v in known else int(v)
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return json_number(float(v))
    if f.type == FieldDescriptor.TYPE_BYTES:
        return v.hex()
    return v
