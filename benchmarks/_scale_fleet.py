"""What benchmarks/scale.py runs beside its coordinator: the island threads' pull limit, each island's heartbeat
thread, and a sharded coordinator's range shards as child processes."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.config.sections import Config

PULLED_BYTES_MAX = 2e9  # update frames the island threads hold at once, at most (the frame size x pulls at once)


def pulls_at_once(islands: int, frame_bytes: float) -> int:
    """How many island threads pull at once: all of them, unless their update frames (about ``frame_bytes`` each)
    would hold more than PULLED_BYTES_MAX of this process's memory (200M parameters, 64 islands: 11.8 GB, which
    the kernel's OOM killer ended); real islands are machines of their own. The coordinator is not limited."""
    return max(1, min(islands, int(PULLED_BYTES_MAX // max(frame_bytes, 1))))


@dataclass
class Heartbeats:
    """Each island's heartbeat thread: every ``period_s``, one try (no retry), reporting the version it holds."""

    clients: list[Any]
    island_ids: list[str]
    held: list[int]  # the version each island holds (its round thread updates it)
    period_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    rtts: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    recording: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(len(self.clients)):
            t = threading.Thread(target=self._loop, args=(i,), name=f"heartbeat-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def _loop(self, i: int) -> None:
        from workers.client import CoordinatorError

        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                self.clients[i].heartbeat(0, island_id=self.island_ids[i], version=self.held[i])
                ok = ""
            except CoordinatorError as e:
                ok = f"{self.island_ids[i]}: {e}"
            rtt = time.perf_counter() - t0
            with self.lock:
                if self.recording:
                    self.rtts.append(rtt)
                    if ok:
                        self.failures.append(ok)
            self.stop.wait(max(0.0, self.period_s - rtt))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


class RangeShards:
    """Range shards 1..S-1 of a sharded coordinator, each a ``dtrain coordinator --shard I`` child process on a
    free port of 127.0.0.1; :attr:`cfg` is the lead's config naming them."""

    def __init__(self, cfg: Config, shards: int, run_dir: Path):
        import subprocess

        from _common import ROOT, child_env, wait_for_file

        from dtrain.config.load import replace, to_toml
        from dtrain_cli.simulate_processes import free_port

        run_dir.mkdir(parents=True)
        secret = run_dir / "shard-secret"
        secret.write_text(os.urandom(32).hex())
        ports = [free_port() for _ in range(shards - 1)]
        self.cfg = replace(cfg, coordinator={"shards": shards, "shard_secret_file": str(secret),
                                             "shard_addresses": tuple(f"127.0.0.1:{p}" for p in ports)})
        (run_dir / "config.toml").write_text(to_toml(self.cfg))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = []
        for k, port in enumerate(ports, start=1):
            log_path = run_dir / f"shard-{k}.log"
            self.logs.append(open(log_path, "w"))
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dtrain_cli", "coordinator", "--config", str(run_dir / "config.toml"),
                 "--shard", str(k), "--port", str(port), "--run-dir", str(run_dir), "--quiet"],
                stdout=self.logs[-1], stderr=subprocess.STDOUT, cwd=ROOT, env=child_env()))
            wait_for_file(run_dir / f"coordinator-shard-{k}.json", self.procs[-1], f"coordinator shard {k}",
                          log_path)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        from _common import stop_process

        for k, p in enumerate(self.procs, start=1):
            stop_process(p, f"coordinator shard {k}")
        for f in self.logs:
            f.close()
