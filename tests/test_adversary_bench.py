"""benchmarks/adversary.py: its options, its verdict on a run and its figures and lines from synthetic summaries
and events, a bad option (the runs themselves are the benchmark's: minutes each)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import load_benchmark
from dtrain.config.load import load_config
from dtrain_cli.fault_spec import parse_fault

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"adversary: attacks=(\d+) survived=(\d+) worst-loss-ratio=(\S+) honest-lost=(\d+) "
                       r"clean-cost=(\S+)")


def _bench() -> ModuleType:
    return load_benchmark("adversary")


def _summary(loss: float, unfinished: tuple[str, ...] = (), quarantined: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"final_eval_loss": loss, "rounds": 6, "unfinished_islands": list(unfinished),
            "quarantined_islands": list(quarantined)}


def test_options_choose_the_attacks() -> None:
    bench = _bench()
    assert bench.parse_args([]).chosen == list(bench.ATTACKS)
    assert bench.parse_args(["--quick"]).chosen == list(bench.QUICK_ATTACKS)
    assert bench.parse_args(["--attacks", "minus20,join-flood,minus20"]).chosen == ["minus20", "join-flood"]
    assert set(bench.ATTACKS) == set(bench.attacks())
    for attack in bench.attacks().values():  # every fault of an attack parses, for 4 islands
        assert all(parse_fault(f, bench.ISLANDS).kind in ("scale", "ramp") for f in attack.faults)
        assert bool(attack.faults) != (attack.side is not None)
    # the Sybil case runs with a token per island, island-2 and island-3 presenting island-1's (refused at Join)
    sybil = bench.attacks()["sybil-ramp"]
    assert sybil.own_tokens and sybil.islands == ("island-2:credential=island-1", "island-3:credential=island-1")
    load_config("tiny", [*bench.RUN_SETTINGS, *sybil.settings])
    # the C reference: the defaults of before the robust merge, a config that loads
    old = load_config("tiny", list(bench.OLD_DEFAULTS)).coordinator
    assert (old.merge_rule, old.round_norm_ratio, old.max_rejections) == ("mean", 0.0, 0)


def test_an_unknown_attack_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "adversary.py"), "--attacks", "minus7"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--attacks: unknown attack(s) minus7" in proc.stderr and "Traceback" not in proc.stderr


def test_the_verdict_on_a_run() -> None:
    verdict = _bench().verdict
    quarantined = [{"event": "island_quarantined", "island": "island-1", "reason": "x"}]
    ok = verdict("minus20", _summary(3.6, quarantined=("island-1",)), quarantined, ("island-1",), None)
    assert ok["survived"] and ok["honest_lost"] == 0 and ok["quarantined"] == ["island-1"] and ok["why"] == []
    lost = verdict("minus3", _summary(3.7), [{"event": "island_lost", "island": "island-2"}], ("island-1",), None)
    assert not lost["survived"] and lost["honest_lost"] == 1 and "island-2" in lost["why"][0]
    hung = verdict("idle200", None, [], (), {"streams": 200}, "workers still running after 480s")
    assert not hung["survived"] and hung["final_eval_loss"] == math.inf and hung["why"][0].startswith("workers")
    joins = [{"event": "island_joined", "name": n} for n in ("island-0", "island-1", "island-2", "island-3")]
    sybil = verdict("sybil-ramp", _summary(3.5), joins, ("island-1", "island-2", "island-3"), None)
    assert not sybil["survived"] and "3 islands joined under one credential" in sybil["why"][0]
    refused = {**_summary(3.5, unfinished=("island-2", "island-3")), "refused_islands": {
        "island-2": "dtrain worker: error: PERMISSION_DENIED: token:island-1 may not act as island island-2: ...",
        "island-3": "dtrain worker: error: DEADLINE_EXCEEDED"}}
    sybil = verdict("sybil-ramp", refused, joins[:2], ("island-1", "island-2", "island-3"), None)
    assert not sybil["survived"] and sybil["why"] == ["refused without a clear reason (PERMISSION_DENIED naming "
                                                      "the token): island-3"]
    refused["refused_islands"]["island-3"] = refused["refused_islands"]["island-2"].replace("island-2", "island-3")
    sybil = verdict("sybil-ramp", refused, joins[:2], ("island-1", "island-2", "island-3"), None)
    assert sybil["survived"] and sybil["byzantine_joined"] == ["island-1"]
    flood = verdict("join-flood", _summary(3.5), joins, (), {"joins": 5000, "joined": 2})
    assert not flood["survived"] and flood["why"] == ["2 flood Joins were accepted"]


def test_figures_and_lines() -> None:
    bench = _bench()
    results = [bench.verdict("minus1", _summary(3.6), [], ("island-1",), None),
               bench.verdict("idle20", None, [], (), None, "workers still running")]
    f = bench.figures(_summary(3.5), _summary(3.49), results)
    assert (f["attacks"], f["survived"], f["honest_lost"]) == (2, 1, 0)
    assert f["worst_loss_ratio"] == math.inf and f["clean_cost"] == pytest.approx(3.5 / 3.49)
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m.groups() == ("2", "1", "inf", "0", f"{3.5 / 3.49:.4f}")
    targets = bench.targets_line(f)
    assert "survived 1/2 (target S = A) NOT met" in targets and "honest-lost 0 (target 0) met" in targets
    f = bench.figures(_summary(3.5), None, results[:1])
    assert f["clean_cost"] is None and "clean-cost=n/a" in bench.final_line(f)
    assert "worst-loss-ratio=1.0286" in bench.final_line(f)
