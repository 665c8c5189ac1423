"""benchmarks/data.py: its stores (written in blocks, reused), its start-up children and read measurement on tiny
stores, its figures and lines, user errors, and (slow) a --quick run end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from conftest import load_benchmark
from dtrain.data.token_store import TokenStore
from dtrain.errors import DtrainError

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"data: startup-ratio=(\d+\.\d\d) rss-ratio=(\d+\.\d\d) read-tokens/s=(\d+)M "
                       r"data-wait=(n/a|\d+\.\d\d%) tokenize-mb/s=(.+) ray-2/1=(n/a|\d+\.\d\d) "
                       r"encode-overhead=(n/a|\d+\.\d\d)")


def _bench() -> ModuleType:
    return load_benchmark("data")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, list[dict[str, Any]]]:
    """Two small stores (1M and 3M ids), written in blocks of 256k ids cut into documents of 100k."""
    bench = _bench()
    work = tmp_path_factory.mktemp("data-bench")
    mp = pytest.MonkeyPatch()
    mp.setattr(bench, "GEN_BLOCK", 1 << 18)
    mp.setattr(bench, "DOC_TOKENS", 100_000)
    try:
        written = [bench.write_store(work / bench.store_name(g), bench.store_tokens(g), "test") for g in (0.001, 0.003)]
    finally:
        mp.undo()
    return bench, written


def test_stores_are_random_ids_written_in_documents_and_reused(stores: tuple[ModuleType, list[dict[str, Any]]]
                                                                  ) -> None:
    bench, written = stores
    small, big = written
    assert [s["tokens"] for s in written] == [1_000_000, 3_000_000] and not small["reused"] and not big["reused"]
    store = TokenStore.open(big["path"])
    m = store.manifest
    assert (m.tokens, m.vocab_size, m.dtype, m.tokenizer) == (3_000_000, bench.VOCAB, "uint16", bench.TOKENIZER_NAME)
    ends = store.doc_ends()  # 256k-id blocks cut at 100k: 100k, 200k, 262144, 362144, ...
    assert ends[-1] == 3_000_000 and ends[0] == 100_000 and ends[2] == 1 << 18 and m.documents == ends.size
    ids = store.read(0, 1 << 18)
    assert ids.max() < bench.VOCAB and len(np.unique(ids)) > 40_000  # random over the whole vocabulary
    again = bench.write_store(Path(big["path"]), 3_000_000, "test")  # the same ids asked again: reused
    assert again["reused"] and again["bytes"] == big["bytes"] > 0
    assert not bench.reusable(Path(big["path"]), 2_000_000)  # another size: written again


def test_startup_children_measure_the_data_work_and_the_ratios_are_their_quotients(
        stores: tuple[ModuleType, list[dict[str, Any]]]) -> None:
    bench, written = stores
    paths = [Path(s["path"]) for s in written]
    start = bench.startup(paths, 1)
    for st, s in zip(start, written, strict=True):
        [run] = st["runs"]
        assert run["tokens"] == s["tokens"] and run["batch_shape"] == [25, 16, 65] and run["eval_shape"] == [8, 16, 65]
        assert run["data_s"] > 0 and run["process_s"] > run["data_s"] and run["imports_s"] > 0
        assert run["rss"] >= run["rss_imports"] > 0 and run["rss_now"] > 0
        assert not run["jax_imported"]  # the data path does not need JAX
        assert st["median_data_s"] == run["data_s"] and st["median_rss"] == run["rss"]
    reads = bench.read_throughput(paths[-1], 30.0, 2 * 8 * 2048)
    assert reads["stream_tokens"] == 2 * 8 * 2048 and reads["windows"] == 16 and reads["tokens_per_s"] > 0
    assert reads["raw_tokens"] > 0 and reads["raw_tokens_per_s"] > 0
    f = bench.figures(written, start, reads, None, None)
    assert f["startup_ratio"] == start[1]["median_data_s"] / start[0]["median_data_s"]
    assert f["rss_ratio"] == start[1]["median_rss"] / start[0]["median_rss"]
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m[1] == f"{f['startup_ratio']:.2f}" and m[4] == "n/a" and m[5] == "n/a" and m[6] == m[7] == "n/a"
    assert len(bench.table(written, start)) == 3


def test_a_failing_child_is_one_error_naming_its_last_line(tmp_path: Path) -> None:
    with pytest.raises(DtrainError, match=r"^the start-up child for \S+ exited with status 1: .*no such file or "
                                          r"folder[^\n]*$"):
        _bench().run_child(tmp_path / "nope")


def _figures(**kw: Any) -> dict[str, Any]:
    f = {"startup_ratio": 1.05, "rss_ratio": 1.02, "read_tokens_per_s": 412.4e6, "data_wait": 0.0031,
         "tokenize": "3.10/5.62@2cores", "encode_overhead": 1.234, "ray_2_over_1": 1.71}
    return {**f, **kw}


def test_lines_from_the_figures() -> None:
    bench = _bench()
    f = _figures()
    m = LAST_LINE.fullmatch(bench.final_line(f))
    assert m and m.groups() == ("1.05", "1.02", "412", "0.31%", "3.10/5.62@2cores", "1.71", "1.23")
    assert bench.final_line(f).endswith(" encode-overhead=1.23")  # the last figure of the last line
    targets = bench.targets_line(f)
    assert "NOT met" not in targets and targets.count(" met") == 7
    f = _figures(startup_ratio=1.5, rss_ratio=1.2, read_tokens_per_s=19e6, data_wait=0.02, tokenize=bench.NOT_BUILT,
                 encode_overhead=1.6, ray_2_over_1=None)
    targets = bench.targets_line(f)
    for what in ("startup-ratio 1.50", "rss-ratio 1.20", "read-tokens/s 19M", "data-wait 2.00%",
                 "encode-overhead 1.60"):
        assert f"{what} (target" in targets and targets.split(what)[1].split(";")[0].endswith("NOT met"), targets
    assert "tokenize-mb/s n/a (dtrain tokenize not built) (target: reported) not measured" in targets
    assert "ray-2/1 n/a (target: reported) not measured" in targets
    assert bench.final_line(f).endswith("data-wait=2.00% tokenize-mb/s=n/a (dtrain tokenize not built) ray-2/1=n/a "
                                        "encode-overhead=1.60")


def test_tokenize_not_built_is_reported_as_such(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = load_benchmark("_data_tokenize")  # benchmarks/data.py's K, E and Y

    def missing(name: str) -> ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(bench.importlib, "import_module", missing)
    assert bench.tokenize_throughput(tmp_path) == {"built": False}


def test_quick_trains_past_the_warm_up_and_a_step_count_that_does_not_is_refused_at_once() -> None:
    bench = _bench()
    warmup, inner = bench.small_schedule()
    assert (warmup, inner) == (50, 50)  # configs/small.toml's; the data-wait run's config refuses fewer steps
    assert bench.parse_args(["--quick"]).train_steps == bench.QUICK_TRAIN_STEPS > warmup
    assert bench.parse_args([]).train_steps == bench.TRAIN_STEPS > warmup
    assert bench.parse_args(["--quick", "--train-steps", "51"]).train_steps == 51
    assert bench.parse_args(["--quick", "--train-steps", "5", "--skip-train"]).skip_train  # not trained: not checked


def test_every_default_store_is_past_the_window_an_island_reads_at_start_up() -> None:
    """A store whose held-out split spans fewer than the 8 chunks the eval windows are spread over, or whose
    island shards hold fewer blocks than a first batch and its read-ahead (16 of 1 Mi ids), reads less at
    start-up (the old --quick's 0.02 G tokens: 87 MiB peak against 144 at 0.16 G): S and R compare like with like
    only past both. The held-out split (5%) is the larger bound: 8 Mi ids / 0.05."""
    bench = _bench()
    assert bench.window_tokens() == 8 * (1 << 20) * 20 == 167_772_160
    assert bench.store_tokens(0.08) < bench.window_tokens() <= bench.store_tokens(min(bench.QUICK_SIZES))
    assert bench.window_tokens() <= bench.store_tokens(min(bench.SIZES))


USAGE = " (benchmarks/data.py --help shows the usage)"


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "0.5"], "benchmarks/data.py: error: argument --sizes: expected two or more positive sizes in G "
                         "tokens like 0.5,4, got '0.5'" + USAGE),
    (["--repeats", "0"], "benchmarks/data.py: error: --repeats must be >= 1, got 0" + USAGE),
    (["--read-seconds", "-1"], "benchmarks/data.py: error: --read-seconds must be > 0, got -1.0" + USAGE),
    (["--quick", "--train-steps", "30"], "benchmarks/data.py: error: --train-steps must be >= 51 (configs/small.toml "
                                         "warms up for 50 steps and merges every 50), got 30; or --skip-train" + USAGE),
])
def test_a_bad_option_is_one_line_and_exit_status_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message]


@pytest.mark.slow
def test_data_benchmark_runs_and_ends_with_the_summary_line(tmp_path: Path) -> None:
    out_json = tmp_path / "data.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data.py"), "--sizes", "0.005,0.04", "--repeats", "1",
         "--read-seconds", "1", "--train-steps", "51", "--skip-tokenize", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = LAST_LINE.fullmatch(lines[-1])
    assert m and m[5] == m[6] == m[7] == "n/a", lines[-1]
    assert lines[-2].startswith("targets: startup-ratio ")
    data = json.loads(out_json.read_text())
    assert data["data_wait"]["steps"] == 51 and data["data_wait"]["data_wait_s"] >= 0
    assert f"{data['figures']['rss_ratio']:.2f}" == m[2]
