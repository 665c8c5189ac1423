"""One config field: its default, its help (the configuration reference is generated from it) and, where the
values are few, its choices."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """A dataclass field whose metadata carries ``help`` and ``choices``."""
    return field(default=default, metadata={"help": help, "choices": choices})
