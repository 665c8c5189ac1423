"""An island's start-up: JAX's persistent compilation cache, and the start timed phase by phase.

A restarted island is the most common recovery, and compiling its steps is most of its start: with
``worker.compile_cache`` (:func:`compile_cache`) JAX writes every program it compiles to that
folder, and a later start of the same program (a restart, another island of the run on the same host or
volume) loads it instead of compiling it. :func:`enable_compile_cache` turns it on before the island compiles
anything; every program is cached, however small or quick to compile (CPU programs are both).

:class:`Startup` times the start from the process's own start to the island's first step, phase by phase
(:data:`PHASES`), and counts the compilation cache's hits and misses meanwhile; the island records it as one
``island_startup`` event and one progress line.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import jax

from dtrain.config.sections import COMPILE_CACHE_OFF, Config
from dtrain.errors import DtrainError

# In the order they happen. imports: from the process's start to the island's code (Python, JAX, the command
# line); devices: JAX's backend and its devices; check: asking the coordinator whether the run is over; data: the
# corpus, the island's shards, the eval batches, the model and its inner loop; compile: the first chunk's scan
# (the other programs compile on a thread of their own meanwhile: workers.island.Deferred); join: the Join;
# pull: θ from the coordinator and the optimizer moments from the island's checkpoint; peers: the start barrier
# (none for an island that rejoins a run in progress); first_step: the first chunk, to its last step's end.
PHASES = ("imports", "devices", "check", "data", "compile", "join", "pull", "peers", "first_step")

# JAX's monitoring events for the persistent cache (jax._src.compilation_cache / compiler)
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class StartupError(DtrainError):
    """The compilation cache's folder cannot be used."""


def compile_cache(cfg: Config, island_dir: Path) -> Path | None:
    """Where the island's compilation cache is: ``worker.compile_cache``, else ``island_dir``/compile-cache (the
    island's folder); None when it is ``off``."""
    where = cfg.worker.compile_cache
    if where == COMPILE_CACHE_OFF:
        return None
    return Path(where).expanduser() if where else island_dir / "compile-cache"


def enable_compile_cache(cfg: Config, island_dir: Path) -> Path | None:
    """Points JAX's persistent compilation cache at :func:`compile_cache` (created if missing) and caches every
    program there; None (and nothing changed) when it is ``off``. Call it before the process's first compile: JAX
    reads the setting once, then. Raises :class:`StartupError` for a folder that cannot be made or written."""
    path = compile_cache(cfg, island_dir)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(f"worker.compile_cache: cannot make {path} ({e.strerror or e}): set it to a writable "
                           f"folder, or to 'off'") from None
    if not os.access(path, os.W_OK):
        raise StartupError(f"worker.compile_cache: {path} is not writable: set it to a writable folder, or to "
                           f"'off'")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program, however quick
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # and however small
    return path


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # fields after the command name (which may hold spaces, in parentheses); starttime is field 22
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class _CacheCounter:
    """Counts JAX's persistent-cache hits and misses (JAX's listeners cannot be removed: one per process)."""

    def __init__(self) -> None:
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **_: Any) -> None:
        if event in (_HIT, _MISS):
            with self._lock:
                if event == _HIT:
                    self.hits += 1
                else:
                    self.misses += 1


_counter: _CacheCounter | None = None
_starts = 0  # Startups made in this process: the first one's imports phase is the process's age


def _cache_counter() -> _CacheCounter:
    global _counter
    if _counter is None:
        _counter = _CacheCounter()
    return _counter


class Startup:
    """The island's start-up, phase by phase (:data:`PHASES`): :meth:`mark` ends the phase in progress. The
    training loop's (and :func:`workers.island.run_worker`'s, before it): no other thread uses it."""

    def __init__(self, cache: Path | None, imports: bool = True) -> None:
        """``cache``: the compilation cache's folder (None: off); ``imports``: the process was started for this
        island (its age is the imports phase; never for a second island run in one process)."""
        global _starts
        self.cache = cache
        self.counter = _cache_counter()
        self.hits0, self.misses0 = self.counter.hits, self.counter.misses
        self.phases: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # each phase's CPU seconds (every thread of the process)
        age = process_age_s() if imports and _starts == 0 else None
        _starts += 1
        self.c = time.process_time()
        if age is not None:
            self.phases["imports"], self.cpu["imports"] = age, self.c
        self.t = time.perf_counter()
        self.reported = False

    def mark(self, phase: str) -> None:
        """Ends ``phase`` now (its seconds: since the last mark; a phase marked twice adds up)."""
        assert phase in PHASES, phase
        now, cpu = time.perf_counter(), time.process_time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.t
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu - self.c
        self.t, self.c = now, cpu

    def record(self) -> dict[str, Any]:
        """The ``island_startup`` event's fields: each phase's seconds, their total, the CPU seconds of each (on
        a loaded host, what the phase cost rather than how long it waited for a core) and the compilation cache
        (its folder, the programs loaded from it and those compiled, the entries it holds now)."""
        phases = {p: round(self.phases[p], 3) for p in PHASES if p in self.phases}
        cpu = {p: round(self.cpu[p], 3) for p in PHASES if p in self.cpu}
        entries = None
        if self.cache is not None:
            try:
                entries = sum(1 for _ in self.cache.iterdir())
            except OSError:
                entries = None
        return {"phases": phases, "total_s": round(sum(self.phases.values()), 3), "cpu_s": cpu,
                "total_cpu_s": round(sum(self.cpu.values()), 3),
                "compile_cache": None if self.cache is None else str(self.cache),
                "cache_hits": self.counter.hits - self.hits0, "cache_misses": self.counter.misses - self.misses0,
                "cache_entries": entries}

    @staticmethod
    def line(name: str, record: dict[str, Any]) -> str:
        """The progress line of an ``island_startup`` event's fields."""
        phases = ", ".join(f"{p.replace('_', ' ')} {s:.1f}" for p, s in record["phases"].items())
        cache = "no compilation cache" if record["compile_cache"] is None else \
            f"compilation cache: {record['cache_hits']} loaded, {record['cache_misses']} compiled"
        return (f"{name}: first step {record['total_s']:.1f}s after the process started ({phases}; "
                f"{record['total_cpu_s']:.1f} CPU seconds; {cache})")
