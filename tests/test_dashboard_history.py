"""The run's history on the dashboard (coordinator/series.py, coordinator/run_view.py, `dtrain dashboard`): kept per
version while the run goes on, served at /api/history, bounded by downsampling, read back from the run's files; and
the page in headless chromium at a run's start, after an island was killed and came back, and after the end."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.run_view import serve_run
from coordinator.series import HISTORY_FILE, MAX_POINTS, RunSeries
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.runlog import read_events
from service_helpers import Running, delta_frame, join_island, push_header
from simulate_helpers import NO_FAKE_DEVICES
from test_dashboard import _chromium, _get
from workers.client import CoordinatorClient

ROOT = Path(__file__).resolve().parent.parent


def _merged(version: int, t: float, tokens: int = 100, island: str = "island-0") -> dict[str, Any]:
    return {"event": "round_merged", "version": version, "t": t, "merge_s": 0.01,
            "pushes": [{"island": island, "tokens": tokens, "bytes": 10}]}


def test_the_series_is_bounded_keeps_its_newest_point_and_marks_recoveries():
    s = RunSeries()
    s.observe({"event": "run_started", "t": 0.0, "run_id": "r", "total_versions": 5000}, 0, {})
    for v in range(1, 3 * MAX_POINTS):
        s.observe(_merged(v, float(v)), 100 * v, {"island-0": 5.0 - v / 10_000})
    assert len(s.points) <= MAX_POINTS and s.stride >= 2
    assert s.points[0]["version"] == 1 and s.points[-1]["version"] == 3 * MAX_POINTS - 1  # the shape, both ends
    assert s.points[-1]["tokens_per_s"] == 100.0 and s.points[-1]["train_loss"] == {"island-0": 5.0 - 0.5999}
    # A coordinator resumed at an earlier version: the merges after it were rolled back; a lost island's next
    # Join is a rejoin; a first Join is not a recovery.
    s.observe({"event": "island_joined", "t": 10.0, "island": "island-1"}, 0, {})
    s.observe({"event": "island_lost", "t": 11.0, "island": "island-1", "reason": "lease expired"}, 0, {})
    s.observe({"event": "island_joined", "t": 15.0, "island": "island-1"}, 0, {})
    s.observe({"event": "coordinator_resumed", "t": 16.0, "version": 7}, 0, {})
    assert [p["version"] for p in s.points][-1] <= 7
    assert [(r["kind"], r["island"]) for r in s.recoveries] == [("lost", "island-1"), ("rejoined", "island-1"),
                                                                ("coordinator", "")]
    assert s.recoveries[1]["text"] == "island-1 joined again after 4 s"
    assert s.recoveries[2]["text"] == "coordinator resumed from version 7"


def test_the_expected_end_follows_the_data_left_after_an_island_is_lost():
    """"v5 of ~N" where the data decides the end: the plan (run_started's) before a merge; then the versions the
    tokens left take at the latest versions' pace, so that an island lost (half the tokens per version) moves N out,
    and its rejoin moves it back; never below the version merged."""
    s = RunSeries()
    s.observe({"event": "run_started", "t": 0.0, "run_id": "r", "total_versions": 0, "expected_versions": 10,
               "tokens_total": 2000}, 0, {})
    assert s.doc()["expected_versions"] is None and s.doc()["run"]["expected_versions"] == 10
    s.observe(_merged(1, 1.0, tokens=200), 200, {})  # two islands' rounds of 100: on plan
    assert s.doc()["expected_versions"] == 10
    s.observe({"event": "island_lost", "t": 1.5, "island": "island-1", "reason": "lease expired"}, 0, {})
    tokens = 200
    for v in range(2, 7):  # island-0 alone: 100 tokens a version, 1,800 left at v1
        tokens += 100
        s.observe(_merged(v, float(v), tokens=100), tokens, {})
    assert s.doc()["expected_versions"] == 6 + 13  # 1,300 left at 100 a version (not the plan's 10)
    for v in range(7, 12):  # island-1 back: 200 a version again
        tokens += 200
        s.observe(_merged(v, float(v), tokens=200), tokens, {})
    assert tokens == 1700 and s.doc()["expected_versions"] == 11 + 2  # 300 left at 200 a version
    s.observe(_merged(12, 12.0, tokens=300), 2000, {})
    assert s.doc()["expected_versions"] == 12  # the data's end: the version merged


def test_history_live_and_from_the_files(net_cfg, tmp_path):
    """An in-process coordinator: /api/history has every merged version with the islands' train losses (their
    heartbeats); after it stops, `dtrain dashboard`'s server reads the same versions and losses back."""
    run_dir = tmp_path / "coord"
    c = Running(net_cfg, run_dir)
    url = c.service.dashboard.url
    clients = [CoordinatorClient(c.address, net_cfg) for _ in range(2)]
    joins = [join_island(cl, f"isl-{i}") for i, cl in enumerate(clients)]
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(c.address))
    n = joins[0].tree_size
    try:
        for version in (1, 2):
            for j, loss in zip(joins, (2.5, 2.7), strict=True):
                stub.Heartbeat(pb.HeartbeatRequest(island_id=j.island_id, version=version - 1, steps=10,
                                                   tokens=640, train_loss=loss / version), timeout=10)
            for cl, j, seed in zip(clients, joins, (0, 1), strict=True):
                cl.push(push_header(j, f"p{version}-{seed}", base=version - 1, start=80 * (version - 1)),
                        delta_frame(n, seed)[1])
        code, _, body = _get(url + "api/history")
        live = json.loads(body)
        assert code == 200 and live["source"] == "coordinator"
        assert [p["version"] for p in live["points"]] == [1, 2]
        assert live["points"][1]["train_loss"] == {"isl-0": 1.25, "isl-1": 1.35}
        assert live["points"][1]["tokens"] == c.service.status_message().tokens_merged > 0
        assert live["points"][1]["pushes"] == 2 and live["points"][1]["bytes_in"] > 0
    finally:
        for cl in clients:
            cl.close()
        c.stop()
    saved = json.loads((run_dir / HISTORY_FILE).read_text())
    assert [p["version"] for p in saved["points"]][0] == 1  # written at the first merge at least
    dash = serve_run(run_dir)
    try:
        files = json.loads(_get(dash.url + "api/history")[2])
        assert files["source"] == "files" and [p["version"] for p in files["points"]] == [1, 2]
        assert files["points"][0]["train_loss"] == {"isl-0": 2.5, "isl-1": 2.7}  # back from history.json
        status = json.loads(_get(dash.url + "api/status")[2])
        assert status["version"] == 2 and status["stopped"] is True
        assert sorted((i["name"], i["state"], i["pushes_merged"]) for i in status["islands"]) == [
            ("isl-0", "stopped", 2), ("isl-1", "stopped", 2)]
    finally:
        dash.close()
    with pytest.raises(DtrainError, match="no events.jsonl"):
        serve_run(tmp_path / "nothing-here")


# ---- the page at a run's start, after a kill, and after its end ------------------------------------------------

RUN_TIMEOUT_S = 300.0


def _wait(what: str, check: Any, proc: subprocess.Popen[bytes] | None, log: Path) -> Any:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            got = check()
        except (urllib.error.URLError, ConnectionError, ValueError, OSError):
            got = None
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (status {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    raise AssertionError(f"not within {RUN_TIMEOUT_S:.0f}s: {what}:\n{log.read_text()[-3000:]}")


def _shot(url: str, path: Path) -> str:
    """A 1280x1400 screenshot of ``url`` into ``path`` (also into $DTRAIN_SCREENS_DIR when set) and its DOM."""
    # Each chromium its own profile: one started while another's processes still hold the default profile hands
    # its work to them and exits 0 without a screenshot.
    profile = path.with_suffix(".profile")
    taken = _chromium(f"--user-data-dir={profile}", f"--screenshot={path}", "--window-size=1280,1400", url)
    assert taken.returncode == 0 and path.exists(), taken.stderr[-2000:]
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000  # a real page, not a blank one
    if os.environ.get("DTRAIN_SCREENS_DIR"):
        shutil.copy(path, Path(os.environ["DTRAIN_SCREENS_DIR"]) / path.name)
    dom = _chromium(f"--user-data-dir={profile}-dom", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def _history(url: str) -> dict[str, Any]:
    return json.loads(_get(url + "api/history")[2])


@pytest.mark.slow
def test_the_whole_run_on_the_page_at_start_after_a_kill_and_after_the_end(tmp_path, compile_cache):
    env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1"}
    env.pop("DTRAIN_TOKEN", None)
    log = tmp_path / "simulate.log"
    runs = tmp_path / "runs"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dtrain_cli", "simulate", "--config", str(ROOT / "configs" / "tiny.toml"),
             "--islands", "2", "--no-pin", "--set", f"run.out_dir={runs}", "--set", "train.steps=300",
             "--set", "outer.inner_steps=10", "--set", "coordinator.eval_every=2", "--set", "data.eval_batches=1",
             "--set", "worker.heartbeat_s=0.5", "--set", "coordinator.lease_s=3", "--set", compile_cache,
             "--fault", "kill:island-1@v3+2s"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        info_path = runs / "tiny" / "coordinator.json"
        _wait("coordinator.json", info_path.exists, proc, log)
        url = json.loads(info_path.read_text())["dashboard"]
        # 1. At the start: both islands joined, the first version merged.
        _wait("the first merge", lambda: len(_history(url)["points"]) >= 1, proc, log)
        start = _shot(url, tmp_path / "dashboard-1-start.png")
        assert 'id="conn" class="ok"' in start and re.search(r'<div class="v">v\d+ of ~\d+</div>', start)
        # 2. Mid-run after the kill: island-1 was lost (its lease) and joined again, and the run went on.
        _wait("island-1's rejoin and a merge after it", lambda: (lambda h: any(
            r["kind"] == "rejoined" for r in h["recoveries"]) and h["points"][-1]["version"] >= 5)(_history(url)),
            proc, log)
        mid = _shot(url, tmp_path / "dashboard-2-after-kill.png")
        assert proc.poll() is None, "the run ended while the browser looked"
        recoveries = re.findall(r'<li class="recovery">(.*?)</li>', re.search(
            r'<ul id="recoveries"[^>]*>(.*?)</ul>', mid, re.S).group(1), re.S)
        assert any("island-1 joined again after" in r for r in recoveries), recoveries
        shown = re.search(r"<main>.*</main>", mid, re.S).group(0)  # what the page shows (not its script)
        assert not re.search(r"t=\d{9,}", shown)  # human times, no raw epoch
        assert re.search(r'data-series="island-1 train" data-points="(\d+)"', mid)
        assert re.search(r'<g class="series rate" data-series="tokens merged / s" data-points="\d+"', mid)
        assert re.search(r'id="card-eta"><div class="k">ETA</div><div class="v">[\d.]+ (s|min)', mid)
        proc.wait(timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
    # 3. After the end: `dtrain dashboard RUN_DIR` serves the whole run from its files.
    run_dir = runs / "tiny"
    merged = sorted({e["version"] for e in read_events(run_dir) if e["event"] == "round_merged"})
    served = subprocess.Popen([sys.executable, "-m", "dtrain_cli", "dashboard", str(run_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        line = served.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert found, line
        url = found.group(1)
        history = _history(url)
        assert [p["version"] for p in history["points"]] == merged == list(range(1, merged[-1] + 1))
        assert history["finished"] and history["finished"]["version"] == merged[-1]
        # "v5 of ~N" followed the data, not the plan: the run took more versions than its 30 (island-1 was away)
        assert history["run"]["expected_versions"] == 30 < merged[-1] == history["expected_versions"]
        assert all(p["train_loss"] for p in history["points"][1:])  # every version has the islands' losses
        end = _shot(url, tmp_path / "dashboard-3-finished.png")
        assert 'id="conn" class="over"' in end and "The run finished at " in end
        assert re.search(r'id="runstate">finished at \d\d:\d\d:\d\d \(v\d+\)', end)
        assert "island-1 joined again after" in end
        # the heartbeats' figures are not in the run's files: shown unknown, not as 0
        assert re.search(r'<td class="num steps">—</td>', end) and not re.search(r'<td class="num steps">0</td>', end)
    finally:
        served.send_signal(signal.SIGINT)
        served.wait(timeout=30)
