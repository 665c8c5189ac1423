"""docs/deploy.md's "Plain machines": its commands, taken from the page and run as written on 127.0.0.1 (the host
name as localhost, free ports for 50051 and 8051, the tiny config for small): certificates, tokens, the corpus, a
TLS coordinator on 0.0.0.0 with a token per island, two workers, `dtrain status`, and after the run `dtrain
dashboard`. And an island whose corpus is not the run's is refused at Join with one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dtrain.runlog import read_events
from dtrain_cli.simulate_processes import free_port
from simulate_helpers import NO_FAKE_DEVICES

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # `dtrain` of the interpreter running the tests


def plain_machines_commands() -> list[str]:
    """The commands of the section's bash block (comments dropped), in order."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    section = page.split("## Plain machines", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block under ## Plain machines"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _env() -> dict[str, str]:
    env = {**os.environ, **NO_FAKE_DEVICES, "PYTHONUNBUFFERED": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    env.pop("DTRAIN_TOKEN", None)
    return env


def _write_corpus(folder: Path) -> None:
    folder.mkdir()
    for i, path in enumerate(sorted((Path(json.__file__).parent).glob("*.py"))):
        (folder / f"doc-{i}.txt").write_text(path.read_text())


def test_the_page_has_the_dozen_commands():
    commands = plain_machines_commands()
    assert 12 <= len(commands) <= 16, commands
    joined = "\n".join(commands)
    for needed in ("openssl req -x509", "dtrain admin issue-token", "dtrain tokenize", "coordinator.host=0.0.0.0",
                   "security.ca=ca.pem", "dtrain status", "--tls-ca ca.pem", "dtrain dashboard"):
        assert needed in joined, needed


@pytest.mark.slow
def test_plain_machines_as_written(tmp_path):
    grpc_port, dash_port, view_port = free_port(), free_port(), free_port()
    subs = [("coord.example.org", "localhost"), ("50051", str(grpc_port)), ("8051", str(dash_port)),
            ("--config small", "--config tiny")]
    commands = []
    for line in plain_machines_commands():
        for old, new in subs:
            line = line.replace(old, new)
        commands.append(line)
    *setup, status, dashboard = commands
    dashboard = dashboard.replace(str(dash_port), str(view_port))  # the coordinator's own may still be held
    _write_corpus(tmp_path / "corpus")
    env = _env()
    groups: list[int] = []
    try:
        for line in setup:
            if line.rstrip().endswith("&"):  # the coordinator and the workers: they run on
                proc = subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, start_new_session=True)
                groups.append(proc.pid)
                proc.wait(timeout=10)
                continue
            done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        # Status, as the operator would ask it while the run goes on (retried while the coordinator starts).
        deadline = time.monotonic() + 120
        while True:
            asked = subprocess.run(["bash", "-c", status], cwd=tmp_path, env=env, capture_output=True, text=True,
                                   timeout=60)
            if asked.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert asked.returncode == 0, asked.stderr + (tmp_path / "coordinator.log").read_text()[-2000:]
        assert re.search(r"run \w+ \(sync mode\)", asked.stdout), asked.stdout
        run_dir = tmp_path / "runs" / "web"
        deadline = time.monotonic() + 300
        while not any(e["event"] == "coordinator_stopped" for e in read_events(run_dir, skip_torn=True)):
            assert time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()[-3000:]
            time.sleep(1)
        for island in ("island-0", "island-1"):
            deadline = time.monotonic() + 120
            while not (tmp_path / "runs" / island / "summary.json").exists():
                assert time.monotonic() < deadline, (tmp_path / f"{island}.log").read_text()[-3000:]
                time.sleep(0.5)
        joined = [e for e in read_events(run_dir) if e["event"] == "island_joined"]
        assert sorted(e["name"] for e in joined) == ["island-0", "island-1"]
        assert {e["identity"] for e in joined} == {"token:island-0", "token:island-1"}  # each its own token
        started = next(e for e in read_events(run_dir) if e["event"] == "coordinator_started")
        assert started["tls"] and started["auth"] and started["address"].startswith("0.0.0.0:")
        merged = [e["version"] for e in read_events(run_dir) if e["event"] == "round_merged"]
        # After the run: its dashboard from its files.
        view = subprocess.Popen(["bash", "-c", f"exec {dashboard}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        groups.append(view.pid)
        assert view.stdout is not None
        line = view.stdout.readline()
        assert f"at http://127.0.0.1:{view_port}/" in line, line
        with urllib.request.urlopen(f"http://127.0.0.1:{view_port}/api/history", timeout=10) as resp:
            history = json.loads(resp.read())
        assert [p["version"] for p in history["points"]] == merged == list(range(1, merged[-1] + 1))
        assert history["finished"] is not None
    finally:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:  # the group's processes have all exited
                pass


@pytest.mark.slow  # ~12 s of processes; in process: test_service.py::test_mismatched_fingerprint_is_refused_...
def test_an_island_on_other_data_is_refused_in_one_line(tmp_path):
    """A real coordinator whose corpus store is on its host, a real worker on the same source cut shorter
    (data.max_bytes: other ids): refused at Join, one line naming data.corpus."""
    env = _env()
    sets = ["--set", f"run.out_dir={tmp_path}", "--set", f"data.cache={tmp_path / 'cache'}"]
    subprocess.run([sys.executable, "-c", "from dtrain.config.load import load_config, data_cache; "
                    "from dtrain.data.corpus import open_corpus; "
                    f"c = load_config('tiny', ['run.out_dir={tmp_path}', 'data.cache={tmp_path / 'cache'}']); "
                    "open_corpus(c.data, c.model.vocab_size, data_cache(c))"], check=True, env=env, cwd=ROOT,
                   timeout=120)
    run = tmp_path / "coord"
    coord = subprocess.Popen([sys.executable, "-m", "dtrain_cli", "coordinator", "--config", "tiny", "--port", "0",
                              "--run-dir", str(run), *sets], stdout=open(tmp_path / "c.log", "w"),
                             stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (run / "coordinator.json").exists():
            assert coord.poll() is None and time.monotonic() < deadline, (tmp_path / "c.log").read_text()
            time.sleep(0.1)
        port = json.loads((run / "coordinator.json").read_text())["port"]
        out = subprocess.run([sys.executable, "-m", "dtrain_cli", "worker", "--config", "tiny", "--coordinator",
                              f"127.0.0.1:{port}", "--island", "island-0", "--run-dir", str(tmp_path / "w"), *sets,
                              "--set", "data.max_bytes=300000"], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=300)
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        assert re.fullmatch(r"dtrain worker: error: FAILED_PRECONDITION: config fingerprint mismatch: data\.corpus: "
                            r"coordinator [0-9a-f]{16}, island [0-9a-f]{16}(@\d+)? \(the island trains on other data: "
                            r"every host needs the same corpus, data\.source and data\.max_bytes\)", last), last
        log = (tmp_path / "c.log").read_text()
        assert "refused Join from island-0: FAILED_PRECONDITION: config fingerprint mismatch: data.corpus" in log
    finally:
        coord.terminate()
        coord.wait(timeout=30)
