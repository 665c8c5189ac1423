"""dtrain: fault-tolerant, multi-datacenter, asynchronous (DiLoCo-style) training on JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dtrain.inference.load import load as load


def __getattr__(name: str) -> Any:
    """``dtrain.load`` (:func:`dtrain.inference.load.load`), imported on first use: ``import dtrain`` (which every
    ``dtrain.*`` import runs) stays free of JAX, as the coordinator's process is."""
    if name == "load":
        from dtrain.inference.load import load

        return load
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
