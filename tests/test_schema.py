"""The one typed loader (dtrain.schema): what it refuses, and how it names the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from dtrain.schema import SchemaError, load


@dataclass(frozen=True)
class _Record:
    state: Literal["live", "lost"]
    flag: Literal[1, 2] = 1


@pytest.mark.parametrize("bad", [[], {}, ["live"], {"live": 1}, None, "gone"])
def test_a_literal_field_refuses_any_other_value_naming_the_field(bad: object) -> None:
    """A list or a dict where a Literal is expected is a SchemaError naming the field, not a TypeError."""
    with pytest.raises(SchemaError) as e:
        load(_Record, {"state": bad})
    assert e.value.path == ("state",) and "is not one of 'live', 'lost'" in e.value.why


def test_a_literal_is_typed_true_is_not_1() -> None:
    assert load(_Record, {"state": "lost", "flag": 2}) == _Record("lost", 2)
    with pytest.raises(SchemaError, match="is not one of 1, 2"):
        load(_Record, {"state": "live", "flag": True})
