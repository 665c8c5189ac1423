"""benchmarks/wan.py: its arguments, figures and lines from synthetic summaries (the runs themselves are the
benchmark's; the link they go through is tested in tests/test_faults.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from conftest import load_benchmark
from dtrain.config.load import load_config
from dtrain.config.sections import ConfigError


def _bench() -> ModuleType:
    return load_benchmark("wan")


def _summary(tmp_path: Path, name: str, utils: list[float], push_bytes: int, down: int) -> dict:
    run = tmp_path / name
    islands = []
    for i, u in enumerate(utils):
        d = run / "islands" / f"island-{i}"
        d.mkdir(parents=True)
        events = [{"event": "push_sent", "bytes": push_bytes + i} for _ in range(4)]
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        islands.append({"island": f"island-{i}", "utilization": u, "bytes_up": 4 * (push_bytes + i),
                        "bytes_down": 4 * down + 5000, "bytes_down_full": 5000,  # + the full θ at join
                        "active_s": 10.0 + i})
    return {"islands": islands, "run_dir": str(run), "final_eval_loss": 2.5, "rounds": 4,
            "audit": {"lost_tokens": 0, "doubled_tokens": 0}}


def test_figures_and_lines(tmp_path: Path) -> None:
    bench = _bench()
    int8 = bench.run_figures(_summary(tmp_path, "a", [0.9, 0.8], 1000, 800))
    sparse = bench.run_figures(_summary(tmp_path, "b", [0.99, 0.97], 100, 80))
    assert int8["util_min"] == 0.8 and int8["wall_s"] == 11.0
    assert int8["up_per_round"] == pytest.approx(1000.5) and int8["down_per_round"] == 800
    assert int8["peak_in_flight"] == 1001 + 800
    runs = {"100mbit/100ms": {"int8": int8, "sparse": sparse}, "20mbit/200ms": {"int8": int8}}
    f = bench.figures(runs, ["100mbit/100ms", "20mbit/200ms"])
    assert f["bytes_ratio"] == pytest.approx((100.5 + 80) / (1000.5 + 800))
    line = bench.final_line(f)
    m = re.fullmatch(r"wan: link=100mbit/100ms util-int8=(\S+) util-sparse=(\S+) bytes-ratio=(\S+) "
                     r"link=20mbit/200ms util-int8=(\S+) util-sparse=(\S+)", line)
    assert m and m.groups() == ("0.800", "0.970", f"{f['bytes_ratio']:.4f}", "0.800", "n/a")
    targets = bench.targets_line(f)
    assert "util-sparse 0.970 on 100mbit/100ms (target >= 0.95) met" in targets
    assert "on 20mbit/200ms (target >= 0.95) not measured" in targets
    assert "int8" in bench.table(runs)


def test_bad_arguments_are_one_line(capsys) -> None:
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--links", "fast"])
    assert "expected RATE/RTT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--codecs", "int3"])
    assert "codecs are" in capsys.readouterr().err
    assert bench.parse_args([]).codecs == ["int8", "int4", "sparse"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--fragments", "1"])
    assert "--fragments must be 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--fragments 3 must divide outer.inner_steps = 50"):
        bench.main(["--fragments", "3"])  # refused before any run starts


def test_the_default_run_adds_sparse_with_two_fragments_where_they_divide_h() -> None:
    bench = _bench()

    def codecs(*argv: str) -> list[str]:
        args = bench.parse_args(list(argv))
        return bench.run_codecs(args, load_config(args.config, args.overrides))

    assert codecs() == ["int8", "int4", "sparse", "sparse-f2"]  # small: H = 50
    assert codecs("--set", "outer.inner_steps=25") == ["int8", "int4", "sparse"]  # 2 does not divide 25
    assert codecs("--codecs", "int8,sparse") == ["int8", "sparse"]  # codecs named: no run added
    assert codecs("--codecs", "sparse", "--fragments", "5") == ["sparse", "sparse-f5"]
    assert codecs("--fragments", "0") == ["int8", "int4", "sparse"]
