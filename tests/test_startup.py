"""An island's start-up (workers/startup.py): the persistent compilation cache, written by one process and read
by the next on JAX's CPU backend; where it is; the start's phases and their record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.config.load import load_config
from workers.startup import PHASES, Startup, StartupError, compile_cache, enable_compile_cache, process_age_s

ROOT = Path(__file__).resolve().parent.parent

# One process's start: the cache enabled as an island enables it, a small train-step-like program compiled, the
# Startup's record printed. Run twice on one folder: the second process loads what the first compiled.
_START = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
from dtrain.config.load import load_config
from workers.startup import Startup, enable_compile_cache
cfg = load_config("tiny", ["worker.compile_cache=" + sys.argv[1]])
startup = Startup(enable_compile_cache(cfg, Path(".")))
startup.mark("devices")
step = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))
w = float(step(jnp.ones((8, 8)), jnp.ones((4, 8))).sum())
startup.mark("compile")
print(json.dumps({**startup.record(), "w": w}))
"""


def _start(cache: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _START, cache], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                         "XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cold = _start(str(cache))
    assert cold["compile_cache"] == str(cache)
    assert cold["cache_misses"] > 0 and cold["cache_hits"] == 0  # compiled, and written to the folder
    entries = sorted(p.name for p in cache.iterdir())
    assert cold["cache_entries"] == len(entries) > 0
    warm = _start(str(cache))
    assert warm["cache_hits"] == cold["cache_misses"] and warm["cache_misses"] == 0  # every program loaded
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new written
    assert warm["w"] == cold["w"]  # the loaded program computes what the compiled one did
    assert {"imports", "devices", "compile"} <= warm["phases"].keys()


def test_where_the_cache_is(tmp_path: Path) -> None:
    island = tmp_path / "islands" / "a"
    assert compile_cache(load_config("tiny"), island) == island / "compile-cache"  # default: the island's folder
    shared = tmp_path / "shared"
    assert compile_cache(load_config("tiny", [f"worker.compile_cache={shared}"]), island) == shared
    assert compile_cache(load_config("tiny", ["worker.compile_cache=off"]), island) is None


def test_a_cache_folder_that_cannot_be_made_is_one_clear_error_before_anything_is_set(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = load_config("tiny", [f"worker.compile_cache={blocker / 'cache'}"])
    with pytest.raises(StartupError, match=r"worker.compile_cache: cannot make .*file/cache.*'off'"):
        enable_compile_cache(cfg, tmp_path)
    assert enable_compile_cache(load_config("tiny", ["worker.compile_cache=off"]), tmp_path) is None


def test_phases_add_up_in_order_and_the_line_names_each() -> None:
    s = Startup(None, imports=False)
    for phase in ("devices", "data", "compile", "compile", "first_step"):
        s.mark(phase)
    with pytest.raises(AssertionError):
        s.mark("lunch")
    r = s.record()
    assert list(r["phases"]) == [p for p in PHASES if p in r["phases"]] == ["devices", "data", "compile",
                                                                            "first_step"]
    assert "imports" not in r["phases"]  # not the process's first island: its age is not this start's
    assert r["total_s"] == pytest.approx(sum(r["phases"].values()), abs=0.01)
    assert list(r["cpu_s"]) == list(r["phases"]) and all(c >= 0 for c in r["cpu_s"].values())
    assert (r["compile_cache"], r["cache_entries"]) == (None, None)
    line = Startup.line("island-1", r)
    assert line.startswith("island-1: first step ") and "first step 0.0" in line and "no compilation cache" in line
    assert " CPU seconds; " in line
    age = process_age_s()
    assert age is None or age > 0


def test_deferred_compiling_waits_for_its_start_and_wait_starts_it() -> None:
    """The deferred programs compile only once started (the island starts them when its first chunk is
    dispatched), and waiting for them starts them if nothing did: nothing is left uncompiled."""
    import threading

    from workers.compiling import Deferred

    ran: list[str] = []
    gate = threading.Event()
    d = Deferred("island-0", lambda: (gate.wait(10), ran.append("compiled")))
    assert not d.started and ran == []  # built, not started
    d.start()
    d.start()  # once
    gate.set()
    d.wait()
    assert ran == ["compiled"]
    lazy = Deferred("island-1", lambda: ran.append("lazy"))
    lazy.wait()  # never started: wait starts it, then waits
    assert ran == ["compiled", "lazy"] and lazy.wait() == 0.0

    def fail() -> None:
        raise RuntimeError("no compiler")

    broken = Deferred("island-2", fail)
    broken.start()
    with pytest.raises(RuntimeError, match="no compiler"):
        broken.wait()
