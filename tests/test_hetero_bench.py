"""benchmarks/hetero.py: its figures, table and lines from synthetic summaries, and its three runs' plan."""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import pytest

from conftest import load_benchmark
from dtrain.config.load import load_config
from dtrain.config.sections import ROUND_AUTO

LAST_LINE = re.compile(r"hetero: util-min-steps=(\S+) util-min-auto=(\S+) loss-ratio-auto=(\S+) wall-ratio-auto=(\S+)")


def _bench() -> ModuleType:
    return load_benchmark("hetero")


def _summary(utils: list[float], loss: float, active: float = 10.0) -> dict[str, Any]:
    islands = [{"island": f"island-{i}", "utilization": u, "active_s": active, "tokens": 1000, "steps": 10}
               for i, u in enumerate(utils)]
    return {"islands": islands, "final_eval_loss": loss, "tokens": 1000 * len(utils), "rounds": 3,
            "audit": {"lost_tokens": 0, "doubled_tokens": 0}}


def test_figures_table_and_lines() -> None:
    bench = _bench()
    runs = {"identical": bench.run_figures(_summary([0.9, 0.9], 2.0)),
            "steps": bench.run_figures(_summary([0.3, 1.0], 2.1)),
            "auto": bench.run_figures(_summary([0.98, 0.99], 2.02, active=12.0))}
    f = bench.figures(runs["identical"], runs["steps"], runs["auto"])
    assert f["util_min_steps"] == 0.3 and f["util_min_auto"] == 0.98
    assert f["loss_ratio_auto"] == pytest.approx(1.01)
    # ideal: 2000 tokens at 1000/(12 x 0.98) + 1000/(12 x 0.99) tokens/s; the wall is 12 s
    ideal = 2000 / (1000 / (12 * 0.98) + 1000 / (12 * 0.99))
    assert f["wall_ratio_auto"] == pytest.approx(12 / ideal)
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m.groups()[:3] == ("0.300", "0.980", "1.0100")
    assert "NOT met" not in bench.targets_line(f)
    assert "NOT met" in bench.targets_line({**f, "util_min_auto": 0.5})
    assert "island-1 util/Mtok" in bench.table(runs)
    one_stopped = {**runs, "auto": bench.run_figures(_summary([0.98], 2.02))}  # the driver stopped island-1
    assert "(stopped)" in bench.table(one_stopped).splitlines()[-1]


def test_plan_gives_the_same_tokens_in_each_run() -> None:
    bench = _bench()
    args = bench.parse_args(["--config", "tiny", "--batches", "8,8,4,2", "--devices", "2,2,1,1",
                             "--inner-steps", "20", "--rounds", "11"])
    runs = bench.plan(load_config("tiny"), args)
    (a, same), (b, differ), (c, differ_c) = runs["identical"], runs["steps"], runs["auto"]
    assert a.train.steps == b.train.steps == 220 and a.train.base_batch_size == 8
    # auto rounds carry H base steps per island whatever the rates: R rounds, (a)'s tokens and outer steps
    assert c.worker.round_seconds == ROUND_AUTO and c.outer.inner_steps == 20 and c.rounds == 11
    assert c.train.steps == a.train.steps and c.train.warmup_steps == a.train.warmup_steps
    assert same[0] == "island-0:host_devices=2" and differ == differ_c
    assert differ[3] == "island-3:train.batch_size=2,host_devices=1,slowdown=4,train.steps_per_call=4"
    assert differ[0] == "island-0:train.batch_size=8,host_devices=2,slowdown=1"


def test_bad_arguments_are_one_line(capsys) -> None:
    with pytest.raises(SystemExit):
        _bench().parse_args(["--speeds", "1,2"])
    assert "speeds are in (0, 1]" in capsys.readouterr().err
