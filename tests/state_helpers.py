"""Helpers the coordinator-state tests share (test_state, test_membership, test_admission, test_quorum): a state
for configs/tiny.toml with an injected clock, a push from a shard's cursor, a refusal that changes nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from conftest import TINY
from coordinator.records import Admission, PushInfo, StateError, StateOptions
from coordinator.state import CoordinatorState
from dtrain.config.load import load_config

T0 = 1000.0
BASE = ["coordinator.lease_s=15", "train.steps=20000"]  # 15 s leases; 1000 rounds: a run ends only where a test says


def options(*overrides: str, **constants: Any) -> StateOptions:
    """The options for configs/tiny.toml (4 islands, sync, 30 s grace, alpha 0.5) with BASE and ``--set``
    overrides; ``constants``: the state's own (max_push_ids, linger_s)."""
    return StateOptions.from_config(load_config(TINY, [*BASE, *overrides]), **constants)


def make(*overrides: str, now: float = T0, **constants: Any) -> CoordinatorState:
    return CoordinatorState(options(*overrides, **constants), "run-1", now)


def join_all(st: CoordinatorState, names=("a", "b", "c", "d"), now: float = T0) -> list[str]:
    return [st.join(n, "cpu", 1, now)[0].island_id for n in names]


_n = [0]


def info(st: CoordinatorState, island_id: str, base: int = 0, tokens: int = 1000, push_id: str | None = None,
         start: int | None = None, end: int | None = None, shard: int | None = None,
         length: int = 40) -> PushInfo:
    """A push over [start, end) of ``shard`` (by default the island's): by default from where the island's
    segment's cursor is in ``st`` (0 for an unknown island), ``length`` sequences long (40: 40 x seq_len 32 =
    1280 tokens; at most tiny's inner_steps 20 x batch_size 8 = 160 sequences, a whole round)."""
    if push_id is None:
        _n[0] += 1
        push_id = f"p{_n[0]}"
    record = st.islands.get(island_id)
    if shard is None:
        shard = 0 if record is None else record.shard_index
    if start is None:  # the island's segment's cursor (another shard's: its cursor while it is one segment)
        start = 0 if record is None else (st.segment_cursor(st.segment(record)) if shard == record.shard_index
                                          else st.shard_cursor(shard))
    return PushInfo(push_id=push_id, island_id=island_id, base_version=base, tokens=tokens, inner_steps=5,
                    cursor_start=start, cursor_end=start + length if end is None else end, shard_index=shard)


def push(st: CoordinatorState, i: PushInfo, now: float = T0) -> Admission:
    """Previews, then commits: with nothing in between, commit_push records the decision admit_push showed."""
    preview = st.admit_push(i, now)
    adm = st.commit_push(i, now)
    assert adm == preview
    return adm


def merge_rounds(st: CoordinatorState, island_id: str, rounds: int) -> None:
    """``rounds`` versions, each merged from one fresh push of ``island_id`` (async mode: one push closes it)."""
    for _ in range(rounds):
        push(st, info(st, island_id, base=st.version))
        st.close_round(T0)


def unchanged(st: CoordinatorState, fn, code: str, *words: str) -> StateError:
    """fn() raises StateError(code) whose reason contains every word, and the state is untouched."""
    before = copy.deepcopy(st.to_json())
    with pytest.raises(StateError) as e:
        fn()
    assert e.value.code == code, str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert st.to_json() == before
    return e.value
