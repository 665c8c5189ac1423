"""Errors that name their cause, against real processes on 127.0.0.1: a plaintext client at a TLS coordinator is told
to set security.ca / --tls-ca; gRPC's own handshake lines are folded into one line of the coordinator's log; a
refused Join is in that log with its reason; `dtrain status` answers at once when nothing listens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from dtrain.config.load import load_config
from dtrain_cli.simulate_processes import free_port
from workers.client import CoordinatorClient, CoordinatorError, PlaintextAtTls

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("DTRAIN_TOKEN", None)
    return env


def _tls_sets(certs: Path) -> list[str]:
    return [f"security.server_cert={certs / 'server.pem'}", f"security.server_key={certs / 'server.key'}",
            f"security.ca={certs / 'ca.pem'}", "security.server_name=localhost"]


@pytest.fixture(scope="module")
def tls_coordinator(certs, tmp_path_factory):
    """`dtrain coordinator` with TLS on 127.0.0.1 (a free port), its log file."""
    run = tmp_path_factory.mktemp("tls-run")
    log = run / "coordinator.log"
    sets = [x for s in _tls_sets(certs) for x in ("--set", s)]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dtrain_cli", "coordinator", "--config", "tiny", "--port", "0",
                                 "--run-dir", str(run), *sets], stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (run / "coordinator.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    port = json.loads((run / "coordinator.json").read_text())["port"]
    yield f"127.0.0.1:{port}", log, proc
    proc.terminate()
    proc.wait(timeout=30)


def test_a_plaintext_client_at_a_tls_port_is_told_to_set_the_ca(tls_coordinator):
    address, log, proc = tls_coordinator
    cfg = load_config("tiny", ["worker.retry_total_s=30"])
    t0 = time.monotonic()
    client = CoordinatorClient(address, cfg)
    with pytest.raises(PlaintextAtTls, match=r"join: the coordinator at 127\.0\.0\.1:\d+ serves TLS and this client "
                                             r"connects in plaintext: set security\.ca .*--tls-ca FILE"):
        client.join("island-p", "cpu", 1)
    client.close()
    assert time.monotonic() - t0 < 10  # not retried for worker.retry_total_s: it cannot get better
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dtrain_cli", "status", "--coordinator", address],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "serves TLS and this client connects in plaintext: set security.ca" in out.stderr
    assert "--tls-ca FILE" in out.stderr and "Traceback" not in out.stderr
    # gRPC's own handshake lines (one per try: several from the worker's retries) are one line of the log, said
    # once for the first; the rest are counted until the next minute or the close.
    time.sleep(0.5)
    text = log.read_text()
    assert "ssl_transport_security" not in text and "Handshake failed with error" not in text, text
    said = [line for line in text.splitlines() if "TLS handshake" in line]
    assert len(said) == 1 and "a TLS handshake failed (WRONG_VERSION_NUMBER)" in said[0], said
    assert "security.ca" in said[0]
    assert proc.poll() is None  # still serving


def test_a_refused_join_is_in_the_coordinators_log_with_its_reason(tls_coordinator, certs):
    address, log, _ = tls_coordinator
    other = load_config("tiny", [*_tls_sets(certs), "model.d_model=64"])
    client = CoordinatorClient(address, other)
    with pytest.raises(CoordinatorError) as e:
        client.join("island-x", "cpu", 1)
    client.close()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    deadline = time.monotonic() + 10
    while "refused Join" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in log.read_text().splitlines() if "refused Join" in line]
    assert len(lines) == 1, log.read_text()[-2000:]
    assert lines[0].endswith("refused Join from island-x: FAILED_PRECONDITION: config fingerprint mismatch: "
                             "model.d_model: coordinator 32, island 64")


def test_status_answers_at_once_when_nothing_listens():
    address = f"127.0.0.1:{free_port()}"  # free: nothing listens there
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dtrain_cli", "status", "--coordinator", address, "--wait", "5"],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 1 and out.stderr == (
        f"dtrain status: error: no coordinator answers at {address} (connection refused: nothing listens there): is "
        f"it running? check --coordinator\n")
    assert took < 4.5, took  # the interpreter's start and imports, not the 5 s wait


def test_the_fold_line_reads_as_one_line():
    from coordinator.grpc_noise import fold_line

    first, later = fold_line(1, None, "WRONG_VERSION_NUMBER"), fold_line(7, 60.0, "")
    assert first.startswith("a TLS handshake failed (WRONG_VERSION_NUMBER): a client speaking plaintext")
    assert later.startswith("7 more TLS handshakes failed in the last 60 s: ") and "\n" not in first + later
