"""Typed plain data to dataclasses and back: the one loader behind config tables and checkpoint JSON.

:func:`load` builds a dataclass from plain data (dicts, lists, str, int, float, bool and None, as TOML and
JSON give them) by walking its fields and their type hints; :func:`dump` turns one back into plain JSON
types. A value that does not fit raises :class:`SchemaError` with the path of the field; the caller words it
as its own error (``dtrain.config.ConfigError``, ``coordinator.state.StateError``), naming the field.

Type hints it reads:

- ``bool``, ``int``, ``str``; ``float`` (an int widens to float); a bool is never taken for a number;
- ``Annotated[int, AtLeast(n)]``: an int >= n; ``Annotated[float, FINITE]``: a finite number;
- ``Literal[...]``: one of the listed values (of the same type: ``True`` is not ``1``);
- ``X | None``; ``tuple[X, ...]`` and ``list[X]`` (a JSON list either way);
- a ``NamedTuple``: a list of exactly its fields, in order (a compact row);
- a dataclass: an object with its fields as keys; unknown keys are refused; a missing key takes the field's
  default with ``partial=True`` (a config section), and is refused otherwise (a checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

T = TypeVar("T")
FieldPath = tuple[str | int, ...]


class SchemaError(ValueError):
    """A value does not fit its declared type; ``path`` names the field (keys and list indices)."""

    def __init__(self, path: FieldPath, why: str):
        super().__init__(f"{format_path(path)}: {why}")
        self.path = path
        self.why = why


@dataclass(frozen=True)
class AtLeast:
    """``Annotated[int, AtLeast(n)]``: the int must be >= n."""

    lo: int


class _Finite:
    def __repr__(self) -> str:
        return "FINITE"


FINITE = _Finite()  # ``Annotated[float, FINITE]``: no NaN or infinity


def format_path(path: FieldPath, root: str = "") -> str:
    """``("islands", 0, "name")`` -> ``root.islands[0].name``."""
    out = root
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type hint, has a default) per field of a dataclass or NamedTuple, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    if dataclasses.is_dataclass(cls):
        return tuple((f.name, hints[f.name], f.default is not dataclasses.MISSING
                      or f.default_factory is not dataclasses.MISSING) for f in dataclasses.fields(cls))
    return tuple((name, hints[name], name in cls._field_defaults) for name in cls._fields)  # type: ignore[attr-defined]


def _is_named_tuple(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def load(cls: type[T], data: Any, partial: bool = False, path: FieldPath = ()) -> T:
    """``cls`` (a dataclass or NamedTuple) from plain data, checked field by field against the type hints."""
    return _load(cls, data, path, partial)


def _load(tp: Any, value: Any, path: FieldPath, partial: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *marks = typing.get_args(tp)
        value = _load(base, value, path, partial)
        for mark in marks:
            if isinstance(mark, AtLeast) and value < mark.lo:
                raise SchemaError(path, f"expected an int >= {mark.lo}, got {value!r}")
            if mark is FINITE and not math.isfinite(value):
                raise SchemaError(path, f"expected a finite number, got {value!r}")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if not any(type(value) is type(c) and value == c for c in choices):
            raise SchemaError(path, f"{value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]  # X | None is the only union the schemas use
        return _load(inner, value, path, partial)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):  # pragma: no cover - schema bug
            raise TypeError(f"only tuple[X, ...] is supported, got {tp!r}")
        if not isinstance(value, list):
            raise SchemaError(path, f"expected a list, got {type(value).__name__}")
        items = [_load(args[0], x, (*path, i), partial) for i, x in enumerate(value)]
        return items if origin is list else tuple(items)
    if _is_named_tuple(tp):
        fields = _fields(tp)
        if not isinstance(value, list) or len(value) != len(fields):
            names = ", ".join(name for name, _, _ in fields)
            raise SchemaError(path, f"expected a list of {len(fields)} fields [{names}], got {value!r}")
        return tp(*(_load(hint, x, (*path, name), partial) for (name, hint, _), x in zip(fields, value)))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SchemaError(path, f"expected an object, got {type(value).__name__}")
        fields = _fields(tp)
        known = {name for name, _, _ in fields}
        for key in value:
            if key not in known:
                raise SchemaError((*path, key), f"unknown key (known: {', '.join(sorted(known))})")
        kwargs = {}
        for name, hint, has_default in fields:
            if name in value:
                kwargs[name] = _load(hint, value[name], (*path, name), partial)
            elif not (partial and has_default):
                raise SchemaError((*path, name), "missing")
        return tp(**kwargs)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SchemaError(path, f"expected a bool, got {_got(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SchemaError(path, f"expected an int, got {_got(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise SchemaError(path, f"expected a number, got {_got(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise SchemaError(path, f"expected a string, got {_got(value)}")
    raise TypeError(f"unsupported schema type {tp!r} at {format_path(path) or '<root>'}")  # pragma: no cover


_SCALARS = (str, int, float, bool, type(None))


def dump(value: Any) -> Any:
    """Plain JSON types from dataclasses (objects), tuples, NamedTuples and lists (lists) and scalars."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):  # scalars inline: a checkpoint holds up to 100 000 push-id rows
        return [x if type(x) in _SCALARS else dump(x) for x in value]
    if type(value) in _SCALARS:
        return value
    raise TypeError(f"cannot dump {type(value).__name__} as plain data")
