"""The container image and what its coordinator does in a pod, checked without a cluster or Docker: the
coordinator's exec probe against a live coordinator serving TLS, a finished run restarted by its Deployment, and the
Dockerfile's structure. The image itself is not built here (no Docker engine in CI).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from conftest import initial_parameters, openssl
from coordinator.app import serve
from coordinator.loading import has_checkpoint
from dtrain.config.load import load_config
from dtrain.config.sections import Config, CoordinatorConfig
from dtrain_cli import probe

ROOT = Path(__file__).resolve().parent.parent


# -- the probe against a live coordinator -----------------------------------------------------------------------


def test_probe_says_serving_over_tls_and_fails_otherwise(tmp_path, monkeypatch):
    """docs/deploy.md's certificate recipe in small: a CA, a server certificate for IP:127.0.0.1 (what the pod's probe
    dials); the probe verifies it with the CA and exits 0, and exits 1 without TLS or with nothing listening."""
    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=dtrain-ca", cwd=tmp_path)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=dtrain-coordinator", cwd=tmp_path)
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:coordinator.dtrain.example.com,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "san.ext", cwd=tmp_path)
    tiny = str(ROOT / "configs" / "tiny.toml")
    ca = f"security.ca={tmp_path / 'ca.crt'}"
    cfg = load_config(tiny, [f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.dashboard_port=-1",
                             "coordinator.checkpoint=false", ca,
                             f"security.server_cert={tmp_path / 'server.crt'}",
                             f"security.server_key={tmp_path / 'server.key'}"])
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "coord", theta, spec, port=0, quiet=True)
    try:
        address = f"127.0.0.1:{port}"
        assert probe.main(["--config", tiny, "--set", ca, "--address", address]) == 0
        assert probe.main(["--config", tiny, "--address", address, "--timeout", "1"]) == 1  # plaintext
    finally:
        server.stop(grace=None).wait()
        service.close()
    assert probe.main(["--config", tiny, "--set", ca, "--address", address, "--timeout", "1"]) == 1


# -- the coordinator after its run ------------------------------------------------------------------------------


def _finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Config, Path]:
    """A run of one version, merged from two islands' pushes and checkpointed, its coordinator stopped: the volume
    a Deployment's next start resumes from (the islands' leases are short, so a resume forgets them quickly)."""
    from service_helpers import delta_frame, join_island, push_header
    from workers.client import CoordinatorClient

    monkeypatch.delenv("DTRAIN_TOKEN", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.out_dir={tmp_path}", "coordinator.port=0", "coordinator.dashboard_port=-1", "coordinator.lease_s=1",
        "outer.islands=2", "train.steps=10", "outer.inner_steps=10", "worker.heartbeat_s=0.25",
        "worker.retry_total_s=1"])
    run_dir = tmp_path / "run"
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, run_dir, theta, spec, port=0, quiet=True)
    try:
        clients = [CoordinatorClient(f"127.0.0.1:{port}", cfg) for _ in range(2)]
        joins = [join_island(c, name) for c, name in zip(clients, "ab", strict=True)]
        for i, (c, j) in enumerate(zip(clients, joins, strict=True)):
            c.push(push_header(j, f"p{i}"), delta_frame(j.tree_size, i)[1])
        for c, j in zip(clients, joins, strict=True):
            c.heartbeat(island_id=j.island_id, version=1)
            c.close()
        assert service.loop.wait_finished().startswith("the run is over (1 versions)")
    finally:
        server.stop(grace=None).wait()
        service.close()
    assert has_checkpoint(cfg, run_dir)
    return cfg, run_dir


def test_a_finished_run_restarted_by_its_deployment_serves_until_sigterm(tmp_path, monkeypatch):
    """The Deployment restarts a coordinator that exits: by default (--after-finish=exit) the resumed finished run
    ends again by itself, health NOT_SERVING, a restart loop. With --after-finish=serve (the manifest's), the run is
    resumed, said finished once (a run_finished event), and served: health SERVING (the probes pass, the Service
    keeps routing), Status, a late island told the run is over (it exits 0), until SIGTERM; then it exits."""
    import json
    import os
    import signal
    import threading
    import time

    import coordinator.lifecycle as lifecycle
    from conftest import initial_spec
    from dtrain.runlog import read_events
    from workers.client import CoordinatorClient
    from workers.membership import run_over_already

    cfg, run_dir = _finished_run(tmp_path, monkeypatch)
    tiny = ["--config", str(ROOT / "configs" / "tiny.toml")]
    server, service, port = serve(cfg, run_dir, None, initial_spec(cfg), port=0, resume=True, quiet=True)
    try:
        assert service.loop.wait_finished().startswith("the run is over (1 versions)")  # exit: it would stop here
        assert probe.main([*tiny, "--address", f"127.0.0.1:{port}", "--timeout", "2"]) == 1  # NOT_SERVING
    finally:
        server.stop(grace=None).wait()
        service.close()

    seen: dict[str, Any] = {}

    def late_island() -> None:
        """What the probes and a late island see once the coordinator says the run is finished; then SIGTERM (only
        to run_coordinator's handler: the test's process must not get the default one)."""
        try:
            deadline = time.monotonic() + 60
            while not any(e["event"] == "run_finished" for e in read_events(run_dir, skip_torn=True)):
                assert time.monotonic() < deadline, "no run_finished event within 60 s"
                time.sleep(0.05)
            address = f"127.0.0.1:{json.loads((run_dir / 'coordinator.json').read_text())['port']}"
            time.sleep(0.3)  # later still: it still serves
            seen["probe"] = probe.main([*tiny, "--address", address, "--timeout", "2"])
            client = CoordinatorClient(address, cfg)
            seen["status"] = client.status(budget_s=0).run_over
            seen["late island"] = run_over_already(client, cfg, tmp_path / "late")
            client.close()
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread below
            seen["error"] = e
        finally:
            if signal.getsignal(signal.SIGTERM) is not handlers[signal.SIGTERM]:
                os.kill(os.getpid(), signal.SIGTERM)

    # the tree's spec as run_coordinator's child process would compute it for a resume, from the session's copy
    monkeypatch.setattr(lifecycle, "initial_parameters_file", lambda *_args, **_kw: (None, initial_spec(cfg)))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=late_island)
    thread.start()
    try:
        summary = lifecycle.run_coordinator(cfg, run_dir, port=0, resume=True, quiet=True, after_finish="serve")
    finally:
        thread.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "error" not in seen, seen
    assert seen["probe"] == 0, "the probe failed after the run finished: readiness would hide it, liveness restart it"
    assert seen["status"].startswith("the run is over") and seen["late island"].startswith("the run is over"), seen
    assert summary["version"] == 1
    events = read_events(run_dir)
    last = [e["event"] for e in events[next(i for i in range(len(events) - 1, -1, -1)
                                          if events[i]["event"] == "coordinator_resumed"):]]
    assert last.count("run_finished") == 1 and last[-2:] == ["run_finished", "coordinator_stopped"], last
    assert events[-1]["reason"] == "SIGTERM received"


# -- the image --------------------------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in (ROOT / "Dockerfile").read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip() if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def test_dockerfile_installs_the_pinned_set_as_a_non_root_dtrain_entry_point():
    """Its structure only: no Docker engine runs in CI, so the image is not built here."""
    import json
    import tomllib

    ins = _dockerfile()
    froms = [a for i, a in ins if i == "FROM"]
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in ins if i == "ARG" and "=" in a}
    assert froms == ["${PYTHON_IMAGE}"] and args["PYTHON_IMAGE"] == "python:3.11-slim", froms
    assert args["ACCELERATOR"] == "cpu", "the CPU image is the default"
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert "pip install -c constraints.txt . $extra" in runs
    assert 'cuda) extra="jax[cuda12]"' in runs and 'tpu) extra="jax[tpu]"' in runs
    copied = {a.split()[0] for i, a in ins if i == "COPY" and not a.startswith("--")}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        assert pattern.rstrip("*") in copied, f"the Dockerfile does not copy the package {pattern.rstrip('*')}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", "constraints.txt", project["readme"], *project["license-files"]}  # what pip reads
    assert needed <= set(next(a for i, a in ins if i == "COPY" and "pyproject.toml" in a).split()[:-1])
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"the image runs as root: {users}"
    entry = json.loads(next(a for i, a in reversed(ins) if i == "ENTRYPOINT"))
    assert entry[-1] == "dtrain" and entry[0] == "tini", entry
    exposed = {int(p) for i, a in ins if i == "EXPOSE" for p in a.split()}
    assert exposed == {CoordinatorConfig().port, CoordinatorConfig().dashboard_port}
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "tests"} <= set(ignored)
