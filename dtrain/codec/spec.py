"""Trees as one flat float32 vector: the spec (the tree's layout), flattening, and the digests of both.

A model's parameters (or a pseudo-gradient) travel as one contiguous float32
vector plus a *spec*, a JSON-native list of ``[path, shape, dtype]`` entries in
a canonical order, so every host that flattens an equal tree gets the same
spec and the same vector layout. :func:`spec_digest` compares layouts across
the wire; :func:`params_digest` (and its incremental form,
:func:`params_hasher` + :func:`hasher_digest`) proves that two hosts hold
bit-identical vectors.

:class:`CodecError`, raised by every module of ``dtrain.codec``, is defined
here, at the bottom of the package's imports. Pure numpy: no JAX (JAX arrays
are copied to the host by ``np.asarray``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Final, Protocol

import numpy as np

__all__ = [
    "CodecError",
    "Hasher",
    "Spec",
    "flatten",
    "hasher_digest",
    "params_digest",
    "params_hasher",
    "spec_digest",
    "spec_size",
    "unflatten",
]


class CodecError(ValueError):
    """Anything wrong with a tree, a vector or a frame; the message names the problem."""


Spec = list[list[Any]]  # [[path: str, shape: list[int], dtype: str], ...], JSON-native


class Hasher(Protocol):
    """What :func:`params_hasher` returns (a hashlib hash object)."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...

_INT_COMPONENT: Final = re.compile(r"0|[1-9][0-9]*")
_LEAF_DTYPES: Final = ("float32", "float16", "bfloat16")  # all exactly representable in float32


def _render_key(key: Any, where: str) -> str:
    """A dict key as a path component: ints (nnx.List indices) as decimals, strings as themselves."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise CodecError(f"key {key!r} under {where!r}: keys must be str or non-negative int")
    if isinstance(key, int):
        if key < 0:
            raise CodecError(f"key {key} under {where!r}: integer keys must be non-negative")
        return str(key)
    if not key or "/" in key:
        raise CodecError(f"key {key!r} under {where!r}: string keys must be non-empty and contain no '/'")
    if _INT_COMPONENT.fullmatch(key):
        raise CodecError(f"key {key!r} under {where!r}: a decimal string key would read back as an int")
    return key


def _sort_key(key: Any) -> tuple[int, Any]:
    return (0, key) if isinstance(key, int) and not isinstance(key, bool) else (1, str(key))


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; a JAX dependency)
    return np.dtype(name)


def _collect(node: Mapping[Any, Any], prefix: str, out: list[tuple[str, np.ndarray]]) -> None:
    for key in sorted(node, key=_sort_key):
        path = f"{prefix}/{_render_key(key, prefix or '/')}" if prefix else _render_key(key, "/")
        value = node[key]
        if isinstance(value, Mapping):
            _collect(value, path, out)
            continue
        leaf = np.asarray(value)
        if leaf.dtype.name not in _LEAF_DTYPES:
            raise CodecError(f"leaf {path!r} has dtype {leaf.dtype.name}; only {', '.join(_LEAF_DTYPES)} "
                             "travel exactly as float32")
        out.append((path, leaf))


def flatten(tree: Mapping[Any, Any]) -> tuple[Spec, np.ndarray]:
    """A nested dict of arrays → (spec, one contiguous float32 vector).

    Keys are visited in sorted order (int keys numerically, before str keys),
    so equal trees give equal specs on every host. ``spec`` is a JSON-native
    list of ``[path, shape, dtype]`` with paths like ``"blocks/0/attn/qkv/kernel"``.
    Leaves must be float32, float16 or bfloat16 (float64 would lose bits
    silently and is refused). Empty sub-dicts carry no leaves and vanish.
    """
    if not isinstance(tree, Mapping):
        raise CodecError(f"tree must be a nested dict of arrays, got {type(tree).__name__}")
    leaves: list[tuple[str, np.ndarray]] = []
    _collect(tree, "", leaves)
    spec: Spec = [[path, [int(d) for d in leaf.shape], leaf.dtype.name] for path, leaf in leaves]
    vec = np.empty(sum(leaf.size for _, leaf in leaves), np.float32)
    offset = 0
    for _, leaf in leaves:
        vec[offset:offset + leaf.size] = leaf.reshape(-1)
        offset += leaf.size
    return spec, vec


def _parse_spec(spec: Any) -> list[tuple[list[str | int], tuple[int, ...], str]]:
    """Validate a spec (it may come off the wire) and split its paths into keys."""
    if not isinstance(spec, (list, tuple)):
        raise CodecError(f"spec must be a list of [path, shape, dtype], got {type(spec).__name__}")
    parsed = []
    for i, entry in enumerate(spec):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise CodecError(f"spec entry {i} must be [path, shape, dtype], got {entry!r}")
        path, shape, dtype = entry
        if not isinstance(path, str) or not path or any(not c for c in path.split("/")):
            raise CodecError(f"spec entry {i}: bad path {path!r}")
        if not isinstance(shape, (list, tuple)) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise CodecError(f"spec entry {i} ({path}): bad shape {shape!r}")
        if dtype not in _LEAF_DTYPES:
            raise CodecError(f"spec entry {i} ({path}): unsupported dtype {dtype!r}")
        keys: list[str | int] = [int(c) if _INT_COMPONENT.fullmatch(c) else c for c in path.split("/")]
        parsed.append((keys, tuple(shape), dtype))
    return parsed


def _leaf_size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def spec_size(spec: Spec) -> int:
    """How many values the flat vector of a (validated) spec holds."""
    return sum(_leaf_size(shape) for _, shape, _ in _parse_spec(spec))


def unflatten(spec: Spec, vec: Any) -> dict[Any, Any]:
    """Inverse of :func:`flatten`: rebuild the nested dict (decimal path components become int keys).

    float32 leaves are reshaped *views* into ``vec`` (no copy); float16/bfloat16
    leaves are cast copies. Raises CodecError if the spec is malformed, paths
    collide, or ``len(vec)`` differs from the spec's total size.
    """
    entries = _parse_spec(spec)
    vec = np.asarray(vec)
    if vec.ndim != 1 or vec.dtype != np.float32:
        raise CodecError(f"vec must be a 1-D float32 array, got shape {vec.shape} dtype {vec.dtype}")
    total = sum(_leaf_size(shape) for _, shape, _ in entries)
    if vec.size != total:
        raise CodecError(f"vec has {vec.size} values but the spec describes {total}")
    root: dict[Any, Any] = {}
    offset = 0
    for keys, shape, dtype in entries:
        size = _leaf_size(shape)
        leaf = vec[offset:offset + size].reshape(shape)
        offset += size
        if dtype != "float32":
            leaf = leaf.astype(_np_dtype(dtype))
        node = root
        for depth, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CodecError(f"spec path {'/'.join(map(str, keys))!r} runs through the leaf "
                                 f"{'/'.join(map(str, keys[:depth + 1]))!r}")
        if keys[-1] in node:
            raise CodecError(f"spec path {'/'.join(map(str, keys))!r} appears twice or collides with a subtree")
        node[keys[-1]] = leaf
    return root


def spec_digest(spec: Spec, length: int = 16) -> str:
    """First ``length`` hex digits of sha256(canonical JSON of spec): compare tree layouts across the wire."""
    canonical = json.dumps(spec, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


def params_hasher() -> Hasher:
    """The hash behind :func:`params_digest`, to feed a vector's bytes slab by slab."""
    return hashlib.sha256()  # SHA-NI: about twice blake2b's speed on current x86


def hasher_digest(h: Hasher) -> str:
    """The params digest from a :func:`params_hasher` that has been fed a vector's bytes."""
    return h.hexdigest()[:32]


def params_digest(vec: np.ndarray) -> str:
    """Digest of a flat float32 parameter vector: islands compare it to prove bit-identical θ."""
    vec = np.ascontiguousarray(vec, dtype=np.float32)
    h = params_hasher()
    h.update(vec.data.cast("B"))  # no copy of θ
    return hasher_digest(h)
