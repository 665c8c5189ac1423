"""Typed plain data to dataclasses and back: the one loader behind config tables and checkpoint JSON.

:func:`load` builds a dataclass from plain data (dicts, lists, str, int, float, bool and None, as TOML and
JSON give them) by walking its fields and their type hints; :func:`dump` turns one back into plain JSON
types. A value that does not fit raises :class:`SchemaError` with the path of the field; the caller words it
as its own error (``dtrain.config.sections.ConfigError``, ``coordinator.records.StateError``), naming the field.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn, TypeVar

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


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def load(cls: type[T], data: Any, partial: bool = False) -> T:
    """``cls`` (a dataclass or NamedTuple) from plain data, checked field by field against the type hints."""
    tp: Any = cls  # a class is hashable (the cache's key); type[T] does not say so
    return _converter(tp, partial)(data)


Convert = Callable[[Any], Any]


def _locate(items: Iterable[tuple[str | int, Convert, Any]]) -> NoReturn:
    """Converts (key, converter, value) one by one to find the one that failed (converters are pure) and
    raises its error with the key prepended."""
    for key, convert, value in items:
        try:
            convert(value)
        except SchemaError as e:
            raise SchemaError((key, *e.path), e.why) from None
    raise AssertionError("a conversion failed, then passed")  # pragma: no cover


@functools.cache
def _converter(tp: Any, partial: bool) -> Convert:
    """A function that checks and converts one value of type ``tp``, built once per type. A failure raises
    SchemaError with the path below this value; containers prepend their key (found again only then)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _annotated(tp, partial)
    if origin is Literal:
        return _literal(tp)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(tp)
        (other,) = [o for o in options if o is not type(None)]  # X | None is the only union the schemas use
        inner = _converter(other, partial)
        return lambda value: None if value is None else inner(value)
    if origin in (list, tuple):
        return _sequence(tp, origin, partial)
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):  # a NamedTuple: a row
        return _row(tp, partial)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record(tp, partial)
    if tp in _SCALAR_CHECKS:
        return _SCALAR_CHECKS[tp]
    raise TypeError(f"unsupported schema type {tp!r}")  # pragma: no cover - a schema bug


def _annotated(tp: Any, partial: bool) -> Convert:
    """``Annotated[X, marks...]``: X's converter, then the :class:`AtLeast` bounds and :data:`FINITE`."""
    base, *marks = typing.get_args(tp)
    inner = _converter(base, partial)
    lows = [m.lo for m in marks if isinstance(m, AtLeast)]
    finite = any(m is FINITE for m in marks)

    def annotated(value: Any) -> Any:
        value = inner(value)
        for lo in lows:
            if value < lo:
                raise SchemaError((), f"expected an int >= {lo}, got {value!r}")
        if finite and not math.isfinite(value):
            raise SchemaError((), f"expected a finite number, got {value!r}")
        return value
    return annotated


def _literal(tp: Any) -> Convert:
    """``Literal[...]``: one of the listed values, of the same type."""
    choices = typing.get_args(tp)

    def literal(value: Any) -> Any:
        # typed: True is not 1; compared one by one, so a list or a dict is refused, not an unhashable TypeError
        if not any(type(value) is type(c) and value == c for c in choices):
            raise SchemaError((), f"{value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    return literal


def _sequence(tp: Any, origin: Any, partial: bool) -> Convert:
    """``list[X]`` or ``tuple[X, ...]`` (``origin`` says which): a JSON list, each item converted."""
    args = typing.get_args(tp)
    if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):  # pragma: no cover - a schema bug
        raise TypeError(f"only tuple[X, ...] is supported, got {tp!r}")
    item, make = _converter(args[0], partial), (list if origin is list else tuple)

    def sequence(value: Any) -> Any:
        if not isinstance(value, list):
            raise SchemaError((), f"expected a list, got {type(value).__name__}")
        try:
            return make([item(x) for x in value])
        except SchemaError:
            _locate((i, item, x) for i, x in enumerate(value))
    return sequence


def _row(tp: Any, partial: bool) -> Convert:
    """A NamedTuple: a list of exactly its fields, in order."""
    fields = [(name, _converter(hint, partial)) for name, hint, _ in _fields(tp)]
    names = ", ".join(name for name, _ in fields)

    def row(value: Any) -> Any:
        if not isinstance(value, list) or len(value) != len(fields):
            raise SchemaError((), f"expected a list of {len(fields)} fields [{names}], got {value!r}")
        try:
            return tp(*[convert(x) for (_, convert), x in zip(fields, value, strict=True)])
        except SchemaError:
            _locate((name, convert, x) for (name, convert), x in zip(fields, value, strict=True))
    return row


def _record(tp: Any, partial: bool) -> Convert:
    """A dataclass: an object with its fields as keys; unknown keys refused, missing ones defaulted with
    ``partial`` (where the field has a default) and refused otherwise."""
    members = [(name, _converter(hint, partial), has_default) for name, hint, has_default in _fields(tp)]
    known = frozenset(name for name, _, _ in members)

    def record(value: Any) -> Any:
        if not isinstance(value, dict):
            raise SchemaError((), f"expected an object, got {type(value).__name__}")
        if not known.issuperset(value):
            key = next(k for k in value if k not in known)
            raise SchemaError((key,), f"unknown key (known: {', '.join(sorted(known))})")
        kwargs = {}
        for name, convert, has_default in members:
            if name in value:
                try:
                    kwargs[name] = convert(value[name])
                except SchemaError as e:
                    raise SchemaError((name, *e.path), e.why) from None
            elif not (partial and has_default):
                raise SchemaError((name,), "missing")
        return tp(**kwargs)
    return record


def _bool(value: Any) -> bool:
    if type(value) is bool:
        return value
    raise SchemaError((), f"expected a bool, got {_got(value)}")


def _int(value: Any) -> int:
    if type(value) is int:  # not a bool
        return value
    raise SchemaError((), f"expected an int, got {_got(value)}")


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:  # an int widens; a bool does not
        return float(value)
    raise SchemaError((), f"expected a number, got {_got(value)}")


def _str(value: Any) -> str:
    if type(value) is str:
        return value
    raise SchemaError((), f"expected a string, got {_got(value)}")


_SCALAR_CHECKS: dict[type, Convert] = {bool: _bool, int: _int, float: _float, str: _str}
_SCALARS = (str, int, float, bool, type(None))


def dump(value: Any) -> Any:
    """Plain JSON types from dataclasses (objects), tuples, NamedTuples and lists (lists) and scalars."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, (list, tuple)):  # scalars inline: a checkpoint holds up to 100 000 push-id rows
        return [x if type(x) in _SCALARS else dump(x) for x in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump(getattr(value, f.name)) for f in dataclasses.fields(value)}
    raise TypeError(f"cannot dump {type(value).__name__} as plain data")
