"""The coordinator's live view (coordinator/dashboard.py): its JSON endpoint is the Status document, its auth is the
gRPC admin side's, its port is configured; and the page itself, loaded in a real headless browser (Debian's
chromium) during a `dtrain simulate` run, shows the live islands and the loss chart."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import initial_parameters
from coordinator.app import serve
from coordinator.dashboard import dashboard_port
from dtrain.config.load import load_config, replace
from dtrain.config.sections import ConfigError
from dtrain.errors import DtrainError
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.proto import dtrain_pb2_grpc as pb_grpc
from dtrain.runlog import read_events
from dtrain.status_doc import message_dict
from service_helpers import Running, delta_frame, join_island, push_header, tls_config
from simulate_helpers import NO_FAKE_DEVICES
from workers.client import CoordinatorClient, CoordinatorError

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-dash-token"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NOW = 1_700_000_000.0  # the in-process coordinators' clock: frozen, so two status snapshots are equal


class Coordinator(Running):
    """An in-process coordinator on 127.0.0.1:0 (its dashboard on any free port) with a frozen clock."""

    def __init__(self, cfg, run_dir: Path):
        super().__init__(cfg, run_dir, clock=lambda: NOW)
        assert self.service.dashboard is not None
        self.url = self.service.dashboard.url


@pytest.fixture
def coord(net_cfg, tmp_path):
    c = Coordinator(net_cfg, tmp_path / "coord")
    yield c
    c.stop()


def _chromium(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Debian's chromium, headless; ``--virtual-time-budget``: the page's timers (its polls) run for 5 s of virtual
    time before the DOM is dumped or the screenshot taken."""
    assert Path(CHROMIUM).exists(), "chromium is not installed (.ci/run installs it: apt-get install chromium)"
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--disable-extensions", "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=timeout)


def _get(url: str, token: str | None = None, method: str = "GET",
         context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_api_status_is_the_status_rpcs_document_with_numbers_as_numbers(coord, net_cfg):
    clients = [CoordinatorClient(f"127.0.0.1:{coord.port}", net_cfg) for _ in range(2)]
    joins = [join_island(c, f"isl-{i}") for i, c in enumerate(clients)]
    n = joins[0].tree_size
    for c, j, name, seed in zip(clients, joins, ("p0", "p1"), (0, 1), strict=True):
        c.push(push_header(j, name), delta_frame(n, seed)[1])
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{coord.port}"))
    stub.Heartbeat(pb.HeartbeatRequest(island_id=joins[0].island_id, version=1, steps=10, tokens=640,
                                       train_loss=2.5, utilization=0.75), timeout=10)
    code, headers, body = _get(coord.url + "api/status")
    assert code == 200 and headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert doc == message_dict(coord.service.status_message())  # the same document as `dtrain status --json`
    assert isinstance(doc["version"], int) and doc["version"] == 1
    assert isinstance(doc["bytes_in"], int) and doc["bytes_in"] > 0 and isinstance(doc["tokens_merged"], int)
    isl = {i["name"]: i for i in doc["islands"]}
    assert isl["isl-0"]["train_loss"] == 2.5 and isl["isl-0"]["utilization"] == 0.75
    assert isinstance(isl["isl-0"]["tokens"], int) and isl["isl-0"]["tokens"] == 640
    assert isl["isl-1"]["train_loss"] is None  # never reported: null, not 0
    assert [r["version"] for r in doc["rounds"]] == [1] and isinstance(doc["rounds"][0]["bytes_in"], int)
    for c in clients:
        c.close()


def test_the_page_names_each_island_by_its_name_with_its_shard_a_column(coord, net_cfg):
    """In chromium: the island table's rows are the islands' names with their shards in a column, and a fault
    (a push refused from its header: more tokens than its range holds) names its island by that name too, not by
    the coordinator's NAME-SHARD id."""
    clients = [CoordinatorClient(f"127.0.0.1:{coord.port}", net_cfg) for _ in range(2)]
    joins = [join_island(c, f"isl-{i}") for i, c in enumerate(clients)]
    assert [j.island_id for j in joins] == ["isl-0-0", "isl-1-1"]  # the wire identity stays as it was
    with pytest.raises(CoordinatorError):
        clients[1].push(push_header(joins[1], "inflated", tokens=10**9), delta_frame(joins[1].tree_size, 1)[1])
    for c in clients:
        c.close()
    faults = coord.service.status_message().faults
    assert "push_refused" in [f.kind for f in faults] and {f.island_id for f in faults} == {"isl-1"}  # its name
    dom = _chromium("--dump-dom", coord.url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rows = re.findall(r'<tr data-island="([^"]+)" class="island">(.*?)</tr>', dom.stdout, re.S)
    shards = {name: dict(re.findall(r'<td class="([^"]+)">([^<]*)</td>', row))["num shard"] for name, row in rows}
    assert shards == {"isl-0": "0", "isl-1": "1"}
    assert re.findall(r'<span class="mono island">([^<]*)</span>', dom.stdout) == ["isl-1 "] * len(faults)
    # (the refusal's own text, its detail, quotes the push's header, which names the coordinator's id)


def test_the_page_is_served_self_contained(coord):
    code, headers, body = _get(coord.url)
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert 'id="islands"' in page and 'id="loss-chart"' in page and "api/status" in page
    # Nothing is loaded from elsewhere: no external script, style or image, and the browser is told so.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"""fetch\(\s*["']https?:""", page)
    assert "default-src 'none'" in headers["Content-Security-Policy"] and "connect-src 'self'" in headers[
        "Content-Security-Policy"]
    assert _get(coord.url + "index.html")[0] == 200


def test_unknown_paths_are_404_and_other_methods_405(coord):
    code, _, body = _get(coord.url + "nope")
    assert code == 404 and "no such path: /nope" in json.loads(body)["error"]
    for method in ("POST", "PUT", "DELETE"):
        code, headers, body = _get(coord.url + "api/status", method=method)
        assert code == 405 and headers["Allow"] == "GET", method
        assert json.loads(body) == {"error": f"method {method} not allowed: the dashboard answers GET only"}


def test_with_a_token_every_request_needs_it_and_failures_are_events(net_cfg, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DTRAIN_TOKEN", TOKEN)
    c = Coordinator(net_cfg, tmp_path / "auth")
    try:
        for token in (None, "wrong-token"):
            code, headers, body = _get(c.url + "api/status", token)
            assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer")
            assert body.count(b"\n") == 1 and "missing or wrong bearer token" in json.loads(body)["error"]
        code, _, body = _get(c.url + "api/status", TOKEN)
        assert code == 200 and json.loads(body)["run_id"] == c.service.run_id
        # The page: with the header, or opened as /?token=TOKEN; the status document only with the header.
        assert _get(c.url, TOKEN)[0] == 200
        assert _get(c.url + f"?token={TOKEN}")[0] == 200
        assert _get(c.url + "?token=wrong")[0] == 401
        assert _get(c.url)[0] == 401
        assert _get(c.url + f"api/status?token={TOKEN}")[0] == 401
        events = [e for e in read_events(tmp_path / "auth") if e["event"] == "auth_failed"]
        # As on the gRPC side (coordinator.refusals.AuthFailures): one event per client host within AUTH_EVENT_S,
        # the first; the refusals after it are counted (written at close).
        assert [e["method"] for e in events] == ["GET /api/status"] and events[0]["count"] == 1
        assert re.fullmatch(r"ipv4:127\.0\.0\.1:\d+", events[0]["peer"])
        faults = c.service.status_message().faults
        assert [f.kind for f in faults] == ["auth_failed"]  # the run's recent faults list it
    finally:
        c.stop()
    events = [e for e in read_events(tmp_path / "auth") if e["event"] == "auth_failed"]
    assert [e["count"] for e in events] == [1, 4]  # the four refusals within the window, written at close
    assert TOKEN not in (tmp_path / "auth" / "events.jsonl").read_text()
    out, err = capfd.readouterr()
    assert TOKEN not in out + err  # no access log with the ?token= in it


def test_https_with_the_grpc_certificate(net_cfg, tmp_path, certs):
    c = Coordinator(tls_config(net_cfg, certs, client_auth=False, client=None), tmp_path / "tls")
    try:
        assert c.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        code, _, body = _get(c.url + "api/status", context=ctx)
        assert code == 200 and json.loads(body)["run_id"] == c.service.run_id
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the HTTPS port: no answer
            _get(c.url.replace("https://", "http://") + "api/status")
        assert _get(c.url + "api/status", context=ctx)[0] == 200  # still serving after that
    finally:
        c.stop()


def test_dashboard_port_config(net_cfg, tmp_path):
    fixed = replace(net_cfg, coordinator={"port": 50051, "dashboard_port": 8051})
    assert dashboard_port(fixed) == 8051
    assert dashboard_port(fixed, grpc_port=0) == 0  # a coordinator on any free port: its dashboard too
    assert dashboard_port(replace(fixed, coordinator={"port": 0})) == 0
    assert dashboard_port(replace(fixed, coordinator={"dashboard_port": -1})) is None
    for bad, why in ((-2, "must be -1 (no dashboard) or in [0, 65535], got -2"),
                     (70000, "must be -1 (no dashboard) or in [0, 65535], got 70000"),
                     (50051, "must differ from coordinator.port (50051)")):
        with pytest.raises(ConfigError, match=re.escape(f"[coordinator] dashboard_port: {why}")):
            load_config(ROOT / "configs" / "tiny.toml", [f"coordinator.dashboard_port={bad}"])
    # Off: no dashboard.
    theta, spec = initial_parameters(net_cfg)
    off = replace(net_cfg, coordinator={"dashboard_port": -1})
    server, service, _ = serve(off, tmp_path / "off", theta, spec, port=0, quiet=True)
    try:
        assert service.dashboard is None
        started = [e for e in read_events(tmp_path / "off") if e["event"] == "coordinator_started"]
        assert started[0]["dashboard"] is None
    finally:
        server.stop(grace=None).wait()
        service.close()
    # A taken port: a one-line error naming the setting, before anything is written to the run folder.
    c = Coordinator(net_cfg, tmp_path / "first")
    try:
        taken = replace(net_cfg, coordinator={"dashboard_port": c.service.dashboard.port})
        with pytest.raises(DtrainError, match=rf"cannot listen on 127\.0\.0\.1:{c.service.dashboard.port} for the "
                                              r"dashboard: .*coordinator\.dashboard_port"):
            serve(taken, tmp_path / "second", theta, spec, port=50999, quiet=True)
        assert not (tmp_path / "second").exists()
        started = [e for e in read_events(tmp_path / "first") if e["event"] == "coordinator_started"]
        assert started[0]["dashboard"] == c.url
    finally:
        c.stop()
    with pytest.raises(urllib.error.URLError):  # closed with the service: the port is released
        _get(c.url + "api/status")


def test_the_page_says_when_the_coordinator_stops_answering(coord, tmp_path):
    """In chromium: the page shows the first answer, then the dashboard goes away (as with a stopped coordinator):
    a red banner says the coordinator is not answering, and the last values stay on the page."""
    dash = coord.service.dashboard
    answered = threading.Event()
    status = dash.status

    def status_then_stop() -> dict[str, Any]:
        doc = status()
        if not answered.is_set():
            answered.set()
            threading.Thread(target=dash.close, daemon=True).start()  # after this answer is sent
        return doc

    dash.status = status_then_stop
    dom = _chromium("--dump-dom", coord.url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert answered.is_set()
    assert 'id="conn" class="down"' in html
    banner = re.search(r'<div id="banner" class="show">([^<]*)</div>', html)
    assert banner and banner.group(1).startswith("The coordinator is not answering since ")
    assert "the values below are from " in banner.group(1)
    assert "Failed to fetch" not in html  # the browser's own words are not what the page says
    assert re.search(r'<span class="meta" id="runstate">coordinator gone since \d\d:\d\d:\d\d</span>', html)
    assert f"run {coord.service.run_id}" in html  # the first answer's values are still shown
    assert re.search(r'id="card-version"><div class="k">version</div><div class="v">v0( of ~[\d,]+)?</div>', html)


# ---- the page in a real browser, during a live run -----------------------------------------------------------

RUN_TIMEOUT_S = 120.0


def _wait_status(url: str, ready: Any, proc: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    doc = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the simulation ended (status {proc.returncode}) before the page was loaded:\n"
                                 f"{log.read_text()[-3000:]}")
        try:
            doc = json.loads(_get(url + "api/status")[2])
        except (urllib.error.URLError, ConnectionError, ValueError):
            doc = None
        if doc is not None and ready(doc):
            return doc
        time.sleep(0.3)
    seen = doc and {"version": doc["version"], "evals": len(doc["evals"]),
                    "islands": [(i["name"], i["steps"], i["train_loss"]) for i in doc["islands"]]}
    raise AssertionError(f"the run did not get far enough within {RUN_TIMEOUT_S:.0f}s (last status: {seen}):\n"
                         f"{log.read_text()[-3000:]}")


def test_the_page_in_a_headless_browser_during_a_simulation(tmp_path, compile_cache):
    """Loads the page in chromium while a 2-island `dtrain simulate` runs: the island table lists the live islands
    with their versions and steps, the loss chart has the global evals' points, the screenshot is a real PNG."""
    env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1"}
    env.pop("DTRAIN_TOKEN", None)
    # Long enough that the run is still going when the browser looks (it is stopped after); an eval every version.
    log = tmp_path / "simulate.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dtrain_cli", "simulate", "--config", str(ROOT / "configs" / "tiny.toml"),
             "--islands", "2", "--no-pin", "--set", f"run.out_dir={tmp_path / 'runs'}", "--set", "train.steps=2000",
             "--set", "outer.inner_steps=5", "--set", "coordinator.eval_every=1", "--set", "data.eval_batches=1",
             "--set", "worker.heartbeat_s=0.5", "--set", compile_cache],  # the session's: programs loaded
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        info_path = tmp_path / "runs" / "tiny" / "coordinator.json"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not info_path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        info = json.loads(info_path.read_text())
        assert isinstance(info["dashboard_port"], int) and info["dashboard_port"] > 0
        url = info["dashboard"]
        assert url == f"http://127.0.0.1:{info['dashboard_port']}/"
        # Live: both islands have trained and reported, a few versions are merged and evaluated.
        # Each island's heartbeats carry the digest of the global θ it holds (verified on arrival): the θ column.
        doc = _wait_status(url, lambda d: d["version"] >= 2 and len(d["evals"]) >= 2 and len(d["islands"]) == 2
                           and all(i["steps"] > 0 and i["train_loss"] is not None and i["params_digest"]
                                   for i in d["islands"]), proc, log)
        # The driver says where (it reads coordinator.json after the coordinator writes it: checked once the
        # islands have trained, long after)
        assert f"live dashboard at {url}" in log.read_text()

        dom = _chromium("--dump-dom", url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        shot = tmp_path / "dashboard.png"
        taken = _chromium(f"--screenshot={shot}", "--window-size=1280,1000", url)
        assert taken.returncode == 0, taken.stderr[-2000:]
        assert proc.poll() is None, "the run ended while the browser looked: it was not a live run"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the driver stops its coordinator and workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # The island table: one row per live island, with its version and steps from the run.
    rows = re.findall(r'<tr data-island="([^"]+)" class="island">(.*?)</tr>', html, re.S)
    assert sorted(name for name, _ in rows) == ["island-0", "island-1"]
    for _, row in rows:
        cells = dict(re.findall(r'<td class="([^"]+)">([^<]*)</td>', row))
        assert cells["state state-live"] == "live"
        assert int(cells["num version"].replace(",", "")) >= 1
        assert int(cells["num steps"].replace(",", "")) > 0
        assert re.fullmatch(r"\d+\.\d{4}", cells["num loss"])  # a train loss, e.g. 3.9121
        assert cells["hw"].startswith("cpu")
    version = re.search(r'id="card-version"><div class="k">version</div><div class="v">v([\d,]+)( of ~[\d,]+)?</div>',
                        html)
    assert version and int(version.group(1)) >= doc["version"] >= 2
    # The loss chart: the global eval series with one circle per eval point the coordinator had (at least).
    chart = re.search(r'<svg id="loss-chart".*?</svg>', html, re.S)
    assert chart
    evals = re.search(r'<g class="series eval" data-series="global eval" data-points="(\d+)">(.*?)</g>',
                      chart.group(0), re.S)
    assert evals and int(evals.group(1)) >= len(doc["evals"]) >= 2
    assert len(re.findall(r'<circle class="pt pt-eval"', evals.group(2))) == int(evals.group(1))
    assert re.search(r'<polyline [^>]*points="[\d.]+,[\d.]+ [\d.]+,[\d.]+', evals.group(2))
    assert 'class="series train"' in chart.group(0)  # the islands' train losses, sampled while the page was open
    assert 'id="conn" class="ok"' in html  # it got answers: no "not answering" banner
    # The screenshot: a PNG of the window's size with real content (a blank page compresses to a few kB).
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 1000) and len(data) > 30_000


def test_the_dashboard_binds_its_own_host_when_set(tmp_path):
    """coordinator.dashboard_host: a coordinator serving gRPC on every interface keeps its dashboard on loopback
    (deploy/ does; reached through kubectl port-forward); unset, the dashboard binds coordinator.host."""
    from coordinator.dashboard import open_dashboard

    cfg = load_config("tiny", ["coordinator.host=0.0.0.0", "coordinator.dashboard_host=127.0.0.1"])
    status = pb.StatusResponse
    own = open_dashboard(cfg, 0, None, status, lambda *a: None)
    try:
        assert own.server.server_address[0] == "127.0.0.1" and own.url.startswith("http://127.0.0.1:")
    finally:
        own.server.server_close()
    same = open_dashboard(replace(cfg, coordinator={"dashboard_host": ""}), 0, None, status, lambda *a: None)
    try:
        assert same.server.server_address[0] == "0.0.0.0"
    finally:
        same.server.server_close()
    with pytest.raises(ConfigError, match="dashboard_host"):
        load_config("tiny", ["coordinator.dashboard_host=a b"])
