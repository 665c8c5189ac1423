"""What the merger's tests share (test_merger*.py): the vector size and block, the merger options of a config,
a push through the spool, and the autouse fixtures every test there runs under (one slab and many; state folders
under tmp_path)."""

import tempfile

import numpy as np
import pytest

from coordinator import direction, merge_types
from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from dtrain import codec
from dtrain.config.load import replace
from dtrain.config.sections import Config

N, BLOCK = 3000, 64


def opts(up: str = "int8", down: str = "int8", error_feedback: bool = True, keep_updates: int = 16,
         mode: str = "sync", rule: str = "mean", **outer: object) -> MergeOptions:
    """The merger options of a default config with these codec, coordinator and outer fields (block: BLOCK); the
    merge rule is the mean unless ``rule`` says otherwise (the hand computations here are of the mean)."""
    cfg = replace(Config(), codec={"up": up, "down": down, "block": BLOCK, "error_feedback": error_feedback},
                  coordinator={"keep_updates": keep_updates, "mode": mode, "merge_rule": rule}, outer=outer)
    return MergeOptions.from_config(cfg)


@pytest.fixture(params=["one-slab", "many-slabs"], autouse=True)
def slabs(request, monkeypatch):
    """Every test runs with one slab and with many (slab = 256 values: 11 full slabs and a partial one)."""
    if request.param == "many-slabs":
        monkeypatch.setattr(merge_types, "SLAB_TARGET", 256)  # the outer step's slabs (merge_types.slab_len)
        monkeypatch.setattr(direction, "SLAB_TARGET", 256)  # the round screen's pieces


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the mergers' state folders go under tmp_path


def push(m: Merger, vec: np.ndarray, weight: float) -> None:
    with m.spool() as sp:
        sp.write(codec.encode(codec.quantize(vec, m.opts.up_bits, BLOCK)))
        m.validate(sp)
        m.add_pending(sp, weight)


def push_keyed(m: Merger, vec: np.ndarray, weight: float, key: str, scale: float = 1.0) -> float:
    with m.spool() as sp:
        sp.write(codec.encode(codec.quantize(vec, m.opts.up_bits, BLOCK)))
        m.validate(sp)
        m.add_pending(sp, weight, scale=scale, key=key)
        return sp.norm
