"""Starts refused before they begin, as a user meets them (real processes, sockets on 127.0.0.1): one line, a
non-zero exit, and nothing left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import TINY

ROOT = Path(__file__).resolve().parent.parent


def _dtrain(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "dtrain_cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def test_a_port_in_use_leaves_no_run_folder(tmp_path: Path) -> None:
    """The coordinator's port is taken by another listener: the start is refused naming the port, and neither the
    --run-dir given nor the default runs/NAME folder is made."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        given = _dtrain("coordinator", "--config", str(TINY), "--port", str(port), "--run-dir",
                        str(tmp_path / "given"), "--quiet", cwd=tmp_path)
        default = _dtrain("coordinator", "--config", str(TINY), "--port", str(port), "--set",
                          f"run.out_dir={tmp_path / 'runs'}", "--quiet", cwd=tmp_path)
    for proc in (given, default):
        assert proc.returncode != 0 and proc.stdout == "", proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("dtrain coordinator: error: cannot listen on 127.0.0.1:") and f":{port}" in line
        assert "already in use" in line and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def test_a_config_name_that_does_not_exist_lists_the_ones_that_do(tmp_path: Path) -> None:
    proc = _dtrain("simulate", "--config", "tinny", cwd=tmp_path)
    names = sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"dtrain simulate: config error: tinny: config file not found, nor a config name "
                           f"(configs/: {', '.join(names)}); did you mean tiny?\n")
    assert list(tmp_path.iterdir()) == []
