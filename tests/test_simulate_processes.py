"""`dtrain simulate` with real processes: a coordinator and worker processes on loopback. Killed workers and
their restarts are in test_simulate_restarts.py."""

from __future__ import annotations

import functools
import http.server
import json
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.config.load import load_config
from dtrain.data.corpus import store_location
from dtrain.runlog import read_events
from dtrain.train.runs import run_simulate_inprocess
from dtrain_cli.simulate import run_simulation
from dtrain_cli.simulate_processes import cpu_shares
from simulate_helpers import NO_FAKE_DEVICES
from simulate_helpers import process_cfg as _cfg

ROOT = Path(__file__).resolve().parent.parent


class _RecordingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder read-only and records every path asked for."""

    paths: list[str]

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        self.paths.append(self.path)
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def served_stores(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """A folder served over HTTP on 127.0.0.1 (a store's remote path, without a cloud account), and the paths
    the server was asked for."""
    root = tmp_path / "served"
    root.mkdir()
    paths: list[str] = []
    handler = functools.partial(type("H", (_RecordingHandler,), {"paths": paths}), directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, paths
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_process_simulation_end_to_end(tmp_path, served_stores, compile_cache):
    """Two worker processes train from a token store they read over HTTP, as from object storage."""
    url, root, asked = served_stores
    store = Path(store_location(_cfg(tmp_path).data, root))  # the built-in corpus, as a store
    cfg = _cfg(tmp_path, f"data.source={url}/{store.name}", compile_cache)  # the session's cache: programs loaded
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    assert f"/{store.name}/manifest.json" in asked and any(f"/{store.name}/tokens/c/" in p for p in asked)
    assert not (tmp_path / "data-cache").exists()  # a store is read where it is, never copied
    assert s["rounds"] == cfg.rounds == 4
    assert s["bit_identical_final_params"]
    assert s["tokens"] == 2 * 40 * cfg.train.batch_size * cfg.model.seq_len
    assert s["final_eval_loss"] < 4.5
    assert s["compression_ratio"] > 3.5  # int8 pushes
    assert 0.0 < s["utilization"] <= 1.0
    out = Path(s["run_dir"])
    saved = json.loads((out / "summary.json").read_text())
    assert {"final_eval_loss", "rounds", "tokens", "bytes_up", "bytes_down", "wall_s", "islands",
            "utilization", "compression_ratio"} <= saved.keys()
    # The token-range audit: every sequence of both shards merged exactly once; all compute went into merges.
    assert saved["audit"]["lost_tokens"] == saved["audit"]["doubled_tokens"] == 0
    assert saved["audit"]["gaps"] == saved["audit"]["overlaps"] == []
    assert saved["audit"]["merged_ranges"] == 2 * cfg.rounds
    assert saved["audit"]["shard_end"] == 40 * cfg.train.batch_size
    assert 0.0 < saved["goodput"] <= 1.0
    events = read_events(out)
    merged = [e for e in events if e["event"] == "round_merged"]
    assert [e["version"] for e in merged] == [1, 2, 3, 4]
    assert all(len(e["pushes"]) == 2 for e in merged)
    pulls = [f for e in events if e["event"] == "pull_served" for f in e["frames"]]
    assert sum(1 for f in pulls if f[0] == "PULL_KIND_FULL") == 2  # one full pull per island, at join
    assert all(f[0] == "PULL_KIND_UPDATE" for f in pulls if f[0] != "PULL_KIND_FULL")
    for isl in s["islands"]:
        assert isl["version"] == 4 and isl["steps"] == 40 and isl["rounds"] == 4
        assert 0.0 <= isl["data_wait_s"] < isl["wall_s"]
        assert (out / "islands" / isl["island"] / "checkpoints").is_dir()
    # Each worker ran on its own share of the CPUs, as its island_started event reports from inside it.
    cpus = sorted(os.sched_getaffinity(0))
    assert s["worker_cpus"] == cpu_shares(2, cpus)
    for i, share in enumerate(s["worker_cpus"]):
        started = [e for e in read_events(out / "islands" / f"island-{i}") if e["event"] == "island_started"]
        assert started[0]["cpus"] == share
    # θ_0 is evaluated (coordinator.eval_every), never before the island's deferred programs (the eval among
    # them) have compiled: an eval compiled on the training path would stall the round.
    kinds = {i: [e["event"] for e in read_events(out / "islands" / f"island-{i}")] for i in range(2)}
    assert sum(k.count("evaluated") for k in kinds.values()) >= 1
    for k in kinds.values():
        assert "evaluated" not in k or k.index("compiled") < k.index("evaluated")


def test_cpu_shares_partition_the_host():
    assert cpu_shares(2, [0, 1]) == [[0], [1]]
    assert cpu_shares(4, [0, 1]) == [[0], [1], [0], [1]]
    assert cpu_shares(3, list(range(8))) == [[0, 3, 6], [1, 4, 7], [2, 5]]
    for islands in range(1, 10):
        for n in (1, 2, 3, 8):
            shares = cpu_shares(islands, list(range(n)))
            assert len(shares) == islands and all(shares)
            used = [c for share in shares for c in share]
            assert sorted(set(used)) == list(range(n))  # every CPU is used
            if islands <= n:
                assert len(used) == n  # and none twice


@pytest.mark.slow  # ~30 s alone; the default run keeps test_process_simulation_end_to_end
def test_lossless_process_mode_without_overlap_matches_the_inprocess_math(tmp_path):
    extra = ("codec.up=fp32", "codec.down=fp32", "worker.overlap=false")
    procs = run_simulation(_cfg(tmp_path / "p", *extra), 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    inproc = run_simulate_inprocess(_cfg(tmp_path / "i", *extra), 2, quiet=True)
    assert procs["tokens"] == inproc["tokens"] and procs["rounds"] == inproc["rounds"]
    assert procs["final_eval_loss"] == pytest.approx(inproc["final_eval_loss"], abs=2e-4)


def test_simulate_cli_reports_a_bad_config_before_starting_anything(tmp_path, capsys):
    from dtrain_cli.main import main

    rc = main(["simulate", "--config", str(ROOT / "configs" / "tiny.toml"), "--islands", "2",
               "--set", f"run.out_dir={tmp_path}", "--set", "codec.up=int3"])
    assert rc == 2
    assert "[codec] up" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # ~13 s; async merging's rules are in test_quorum.py and test_service.py
def test_async_mode_merges_every_delta_on_arrival(tmp_path):
    cfg = _cfg(tmp_path, "coordinator.mode=async", "codec.up=int4", "codec.down=int4")
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    events = read_events(Path(s["run_dir"]))
    merged = [e for e in events if e["event"] == "round_merged"]
    assert len(merged) == 2 * cfg.rounds  # one version per delta
    assert all(len(e["pushes"]) == 1 for e in merged)
    assert s["bit_identical_final_params"] and s["final_eval_loss"] < 4.8
    assert s["compression_ratio"] > 6.0  # int4 pushes
    stale = [p["staleness"] for e in merged for p in e["pushes"]]
    assert max(stale) >= 1  # islands pushed against versions the other had already moved on from


@pytest.mark.slow  # ~30 s alone; the default run keeps test_process_simulation_end_to_end
def test_wall_time_rounds_let_islands_run_different_step_counts(tmp_path):
    cfg = _cfg(tmp_path, "worker.round_seconds=1.5", "train.steps=400", "outer.inner_steps=100")
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    assert s["rounds"] == cfg.rounds == 4 and s["bit_identical_final_params"]
    events = read_events(Path(s["run_dir"]))
    for e in (e for e in events if e["event"] == "round_merged"):
        # Token weights are what each island really trained in its 1.5 s (steps differ between islands).
        assert all(p["weight"] == p["tokens"] > 0 for p in e["pushes"])
    assert all(i["steps"] > 0 for i in s["islands"])
    # No fixed shard end: each shard is audited below its highest merged end.
    assert s["audit"]["shard_end"] is None and s["audit"]["merged_ranges"] == 2 * cfg.rounds
    assert s["audit"]["lost_tokens"] == s["audit"]["doubled_tokens"] == 0 and 0.0 < s["goodput"] <= 1.0


def test_status_command_shows_the_coordinator_view(tmp_path, capsys):
    from conftest import initial_parameters
    from coordinator.app import serve
    from dtrain_cli.main import main

    cfg = _cfg(tmp_path)
    theta, spec = initial_parameters(cfg)
    server, service, port = serve(cfg, tmp_path / "c", theta, spec, port=0, quiet=True)
    try:
        rc = main(["status", "--coordinator", f"127.0.0.1:{port}", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["run_id"] == service.run_id and out["mode"] == "sync"
    finally:
        server.stop(None).wait()
        service.close()


def _digests(run_dir: Path, island: str, processes: int) -> list[str]:
    """The final θ digest in the summary of every process of ``island`` (process 0's first)."""
    from dtrain.runlog import process_dir

    return [json.loads((process_dir(run_dir / "islands" / island, i) / "summary.json").read_text())["params_digest"]
            for i in range(processes)]


@pytest.mark.slow  # ~25 s on 2 cores: 4 worker processes and a coordinator start JAX
def test_process_simulation_with_two_process_islands(tmp_path):
    """``--island-processes 2``: each of 2 islands is one jax.distributed job of 2 worker processes (one CPU device
    each): the coordinator sees 2 islands of 2 devices, every process ends on its final θ, the audit is clean and
    counts each island's steps once, and both processes of an island ran on the island's CPUs."""
    cfg = _cfg(tmp_path, "train.steps=20")
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300, island_processes=2)
    out = Path(s["run_dir"])
    assert s["rounds"] == cfg.rounds == 2 and s["bit_identical_final_params"] and s["island_processes"] == 2
    events = read_events(out)
    joins = [e for e in events if e["event"] == "island_joined"]
    assert sorted(e["name"] for e in joins) == ["island-0", "island-1"]  # one island per jax.distributed job
    stopped = next(e for e in events if e["event"] == "coordinator_stopped")
    for island in ("island-0", "island-1"):
        assert _digests(out, island, 2) == [stopped["params_digest"]] * 2, island
    a = s["audit"]
    assert (a["lost_tokens"], a["doubled_tokens"], a["gaps"], a["overlaps"]) == (0, 0, [], [])
    assert a["merged_ranges"] == 2 * cfg.rounds and a["steps_executed"] == 2 * cfg.train.steps  # not 4 x
    assert s["tokens"] == 2 * cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len
    for isl in s["islands"]:
        assert isl["devices"] == 2 and isl["steps"] == cfg.train.steps
    for i, share in enumerate(s["worker_cpus"]):
        island = out / "islands" / f"island-{i}"
        for folder in (island, island / "process-1"):
            started = [e for e in read_events(folder) if e["event"] == "island_started"]
            assert [e["cpus"] for e in started] == [share], folder
            assert (folder / "worker.log").is_file()
    starts = [e for e in read_events(out / "driver") if e["event"] == "worker_started"]
    assert len(starts) == 2 and all(e["processes"] == 2 and len(e["pids"]) == 2 for e in starts)
    assert len({e["jax_coordinator"] for e in starts}) == 2  # a jax.distributed port per island


@pytest.mark.slow  # ~42 s on 2 cores: the restarted processes compile again (~16 s)
def test_a_killed_two_process_island_restarts_both_processes_and_rejoins(tmp_path):
    """``kill:island-1@v1+1s`` on islands of 2 processes: the driver SIGKILLs both processes of island-1 and
    starts both again (on the island's jax.distributed port); the island rejoins under its name, and the run ends
    with every sequence merged once and every process on the coordinator's final θ."""
    from dtrain_cli.fault_spec import parse_fault

    cfg = _cfg(tmp_path, "train.steps=40", "coordinator.lease_s=30")
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=400, island_processes=2,
                       faults=[parse_fault("kill:island-1@v1+1s", 2)])
    out = Path(s["run_dir"])
    (fault,) = s["faults"]
    assert fault["fault"] == "kill:island-1@v1+1s" and fault["recovery"] == "restarted", fault
    assert fault["version"] < cfg.rounds  # mid-run
    assert s["bit_identical_final_params"] and not s["unfinished_islands"]
    a = s["audit"]
    assert (a["lost_tokens"], a["doubled_tokens"], a["gaps"], a["overlaps"]) == (0, 0, [], [])
    events = read_events(out)
    joins = [e for e in events if e["event"] == "island_joined" and e["name"] == "island-1"]
    assert len(joins) == 2 and joins[1]["reason"].startswith("rejoined"), joins
    stopped = next(e for e in events if e["event"] == "coordinator_stopped")
    for island in ("island-0", "island-1"):
        assert _digests(out, island, 2) == [stopped["params_digest"]] * 2, island
    for folder in ("island-1", "island-1/process-1"):  # both processes started twice; island-0's once
        started = [e for e in read_events(out / "islands" / folder, skip_torn=True) if e["event"] == "island_started"]
        assert len(started) == 2, folder
    starts = [e for e in read_events(out / "driver") if e["event"] == "worker_started" and e["island"] == "island-1"]
    assert len(starts) == 2 and starts[0]["jax_coordinator"] == starts[1]["jax_coordinator"]
    assert not set(starts[0]["pids"]) & set(starts[1]["pids"])


def test_simulate_refuses_bad_island_process_counts(tmp_path, capsys):
    from dtrain_cli.main import main

    base = ["simulate", "--config", str(ROOT / "configs" / "tiny.toml"), "--islands", "2",
            "--set", f"run.out_dir={tmp_path}"]
    for value, message in (("0", "0: an island has at least 1 process"),
                           ("two", "'two' is not a number of processes"), ("1.5", "'1.5' is not a number")):
        with pytest.raises(SystemExit) as exit_:
            main([*base, "--island-processes", value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--island-processes" in err[0] and message in err[0], err
    assert main([*base, "--inprocess", "--island-processes", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dtrain simulate: config error: --island-processes needs worker processes: drop --inprocess"]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("extra", "message"), [
    (["--fault", "device-dead:island-1@step5,device=0"],
     "--fault device-dead:island-1@step5,device=0: device faults need single-process islands"),
    (["--set", "health.enabled=true"], "[health] enabled: chip health needs single-process islands"),
])
def test_simulate_refuses_what_multi_process_islands_cannot_run(tmp_path, capsys, extra, message):
    from dtrain_cli.main import main

    rc = main(["simulate", "--config", str(ROOT / "configs" / "tiny.toml"), "--islands", "2", "--island-processes",
               "2", "--set", f"run.out_dir={tmp_path}", *extra])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtrain simulate: config error: ") and message in err[0], err
    assert not any(tmp_path.iterdir())


def test_check_island_processes():
    from dtrain.config.sections import ConfigError
    from dtrain_cli.fault_spec import parse_fault
    from dtrain_cli.simulate import check_island_processes

    cfg = load_config(ROOT / "configs" / "tiny.toml")
    check_island_processes(1, cfg, [parse_fault("device-dead:island-0@step5,device=0", 2)])  # one process: fine
    check_island_processes(3, cfg, [parse_fault("kill:island-0@v1+1s", 2), parse_fault("nan:island-1@v1", 2)])
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(ConfigError, match="--island-processes: must be an integer >= 1"):
            check_island_processes(bad, cfg, [])


def test_island_process_flags_match_the_worker():
    from dtrain_cli.simulate_processes import island_process_flags
    from workers.hosts import resolve_processes

    assert island_process_flags(1, 0, "127.0.0.1:1") == []
    for index in range(3):
        flags = island_process_flags(3, index, "127.0.0.1:8476")
        values = dict(zip(flags[::2], flags[1::2], strict=True))
        got = resolve_processes(int(values["--num-processes"]), int(values["--process-id"]),
                                values["--jax-coordinator"], {})
        assert (got.count, got.index, got.coordinator) == (3, index, "127.0.0.1:8476")


def test_a_failed_process_ends_its_island_and_is_named_with_its_log(tmp_path):
    """A process of a two-process island exits non-zero: the driver kills the island's other process (which would
    wait for jax.distributed's peer timeout) and the run's error names the island, the failed process and its log,
    not the process it killed."""
    import subprocess
    import sys

    from dtrain_cli.simulate_processes import Simulation

    sim = Simulation(_cfg(tmp_path), tmp_path, 2, True, dict(os.environ), False, [], 2)
    try:
        log = tmp_path / "islands" / "island-1" / "process-1" / "worker.log"
        log.parent.mkdir(parents=True)
        log.write_text("compiling\nWorkerError: the island's mesh needs 2 devices\n")
        sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
        sim.workers = {"island-0": [subprocess.Popen(sleep), subprocess.Popen(sleep)],
                       "island-1": [subprocess.Popen(sleep), subprocess.Popen([sys.executable, "-c", "exit(3)"])]}
        sim.workers["island-1"][1].wait()
        sim._end_broken_islands()
        assert sim.ended == {"island-1": 1}
        assert [p.poll() for p in sim.workers["island-1"]] == [-9, 3]  # process 0 killed by the driver
        assert all(p.poll() is None for p in sim.workers["island-0"])  # the other island goes on
        assert sim._failures() == ["island-1 process 1 (status 3: WorkerError: the island's mesh needs 2 devices; "
                                   "see islands/island-1/process-1/worker.log)"]
        ended = [e for e in read_events(tmp_path / "driver") if e["event"] == "island_ended"]
        assert [(e["island"], e["process"], e["status"]) for e in ended] == [("island-1", 1, 3)]
    finally:
        sim.stop_all()


def test_an_island_of_two_processes_is_started_whole_and_again_on_its_port(tmp_path, monkeypatch):
    """How the driver starts an island of 2 processes (the commands recorded, nothing run): both get the island's
    name and run folder, process flags with the island's jax.distributed address, its push faults and its CPU
    pinning (the CPUs a process inherits, with no preexec_fn: no fork running Python in a process with JAX's
    threads); a restart starts both again on the same address; another island gets its own."""
    import dtrain_cli.simulate_processes as simulate_processes
    from dtrain_cli.fault_spec import parse_fault

    started: list[tuple[list[str], set[int]]] = []
    own_cpus = os.sched_getaffinity(0)

    class Recorded:
        def __init__(self, cmd, **kwargs):
            assert kwargs.get("preexec_fn") is None
            started.append((cmd, os.sched_getaffinity(0)))  # what a child started now inherits
            self.pid = len(started)

    monkeypatch.setattr(simulate_processes.subprocess, "Popen", Recorded)
    faults = [parse_fault("nan:island-1@v1", 2)]
    sim = simulate_processes.Simulation(_cfg(tmp_path), tmp_path, 2, True, {}, True, faults, 2)
    try:
        sim.port = 1234
        sim._start_worker("island-1")
        sim._start_worker("island-1")  # a restart
        sim._start_worker("island-0")
    finally:
        for f in sim.logs:  # nothing ran: the log files alone to close
            f.close()
    assert len(started) == 6 and os.sched_getaffinity(0) == own_cpus  # this thread's CPUs again after each start
    assert [cpus for _, cpus in started] == [set(sim.shares[1])] * 4 + [set(sim.shares[0])] * 2
    args = [cmd[cmd.index("worker") + 1:] for cmd, _ in started]  # every flag takes a value
    flags = [dict(zip(a[::2], a[1::2], strict=True)) for a in args]
    assert [f["--process-id"] for f in flags] == ["0", "1"] * 3
    assert all(f["--num-processes"] == "2" and f["--coordinator"] == "127.0.0.1:1234" for f in flags)
    assert [f["--island"] for f in flags] == ["island-1"] * 4 + ["island-0"] * 2
    assert {f["--run-dir"] for f in flags[:4]} == {str(tmp_path / "islands" / "island-1")}  # process-I: the worker's
    addresses = [f["--jax-coordinator"] for f in flags]
    assert len(set(addresses[:4])) == 1 and addresses[4] == addresses[5] != addresses[0]
    assert [f.get("--inject") for f in flags] == ["nan@v1"] * 4 + [None] * 2  # every process of the island
    assert (tmp_path / "islands" / "island-1" / "process-1" / "worker.log").is_file()


@pytest.mark.slow  # ~30 s on 2 cores: the one end-to-end proof of the sparse codec and SparseLoCo in process mode
def test_sparseloco_in_process_mode_pushes_sparse_frames_and_islands_agree(tmp_path):
    """Real worker processes push sparse 2-bit frames (top 5% per chunk, decaying error feedback) to a real
    coordinator, which merges them with the sparseloco rule and broadcasts sparse updates; every island ends on
    the coordinator's θ bit for bit, and the frames are what a 5% sparse code costs."""
    cfg = _cfg(tmp_path, "codec.up=sparse", "codec.down=sparse", "codec.density=0.05", "codec.sparse_chunk=1024",
               "outer.rule=sparseloco", "outer.sparseloco_beta=0.9")
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    merged = [e for e in read_events(Path(s["run_dir"])) if e["event"] == "round_merged"]
    assert len(merged) == cfg.rounds
    assert s["bit_identical_final_params"] and math.isfinite(s["final_eval_loss"])
    assert s["compression_ratio"] > 30  # 5% of the values at ~18 bits each (uncompressed): ~35x


@pytest.mark.slow  # ~30 s on 2 cores: the one end-to-end proof of the mask codec in process mode
def test_the_mask_codec_in_process_mode_pushes_masked_frames_and_islands_agree(tmp_path):
    """Real worker processes push mask frames (the entries their base version's mask selects, 2 bits each, no
    index) to a real coordinator, which merges them with the sparseloco rule and broadcasts its update on the same
    mask; every island ends on the coordinator's θ bit for bit, and the frames cost what a quarter of the values
    at 2 bits does."""
    cfg = _cfg(tmp_path, "codec.up=mask", "codec.down=mask", "codec.mask_density=0.25", "codec.sparse_chunk=1024",
               "outer.rule=sparseloco", "outer.sparseloco_beta=0.5")
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300)
    merged = [e for e in read_events(Path(s["run_dir"])) if e["event"] == "round_merged"]
    assert len(merged) == cfg.rounds
    assert s["bit_identical_final_params"] and math.isfinite(s["final_eval_loss"])
    assert 40 < s["compression_ratio"] < 80  # 32 bits over 25% at 2 bits: 64x (scales add, zstd takes a little)


@pytest.mark.slow  # ~13 s of processes; one island's token acting as another's is in test_identity.py
def test_a_sybil_presenting_another_islands_token_is_refused_at_join_and_the_run_ends(tmp_path, compile_cache):
    """`dtrain simulate --island-tokens`: each island gets its own issued token; island-1 presents
    island-0's (``--island island-1:credential=island-0``, the Sybil case): the coordinator refuses its Join with
    PERMISSION_DENIED naming the token, the driver counts it as refused (not a failure), and island-0 finishes the
    run alone (it takes over island-1's shard: every token merged once)."""
    from dtrain_cli.island_spec import parse_islands

    cfg = _cfg(tmp_path, "train.steps=20", "worker.start_wait_s=5", compile_cache)
    s = run_simulation(cfg, 2, quiet=True, env=NO_FAKE_DEVICES, timeout_s=300, own_tokens=True,
                       island_specs=parse_islands(["island-1:credential=island-0"], 2, cfg))
    assert list(s["refused_islands"]) == ["island-1"]
    line = s["refused_islands"]["island-1"]
    assert "PERMISSION_DENIED" in line and "token:island-0 may not act as island island-1" in line
    assert s["unfinished_islands"] == ["island-1"] and [i["island"] for i in s["islands"]] == ["island-0"]
    out = Path(s["run_dir"])
    events = read_events(out)
    assert {e["name"] for e in events if e["event"] == "island_joined"} == {"island-0"}  # and again, for shard 1
    assert s["audit"]["lost_tokens"] == s["audit"]["doubled_tokens"] == 0
    assert sorted(r["shard"] for e in events if e["event"] == "round_merged" for r in e["pushes"]) == [0, 0, 1, 1]


def test_a_run_whose_islands_were_all_quarantined_is_one_error_not_a_crash(tmp_path) -> None:
    """The summary of a run in which the coordinator quarantined every island (no island finished) is a
    SimulationError naming why, not an IndexError."""
    from types import SimpleNamespace

    from dtrain_cli.simulate_processes import SimulationError
    from dtrain_cli.simulate_report import run_summary

    sim = SimpleNamespace(out=tmp_path, cfg=_cfg(tmp_path), names=["island-0", "island-1"], gone=set(),
                          stopped=set(), refused={}, processes=1)
    events = [{"event": "island_quarantined", "island": f"island-{i}"} for i in range(2)]
    with pytest.raises(SimulationError, match=r"no island finished the run \(2 of 2 quarantined"):
        run_summary(sim, 1.0, events, {}, None)  # type: ignore[arg-type]


def test_an_island_that_finished_but_is_slow_to_exit_is_not_counted_as_stopped(tmp_path) -> None:
    """After the coordinator exits, the driver terminates islands still running; one whose events hold
    ``island_finished`` (its summary written) still counts as finished, one without is stopped."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from dtrain_cli.simulate_processes import Simulation

    for name, finished in (("island-0", True), ("island-1", False)):
        d = tmp_path / "islands" / name
        d.mkdir(parents=True)
        events = [{"event": "island_started"}] + ([{"event": "island_finished", "version": 3}] if finished else [])
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    procs = {n: [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
             for n in ("island-0", "island-1")}
    logged: list[tuple[str, dict]] = []
    sim = SimpleNamespace(workers=procs, out=tmp_path, stopped=set(), late=set(), gone=set(), ended={}, specs={},
                          processes=1, log=SimpleNamespace(event=lambda ev, **kw: logged.append((ev, kw)),
                                                           progress=lambda line: None))
    sim._running = lambda n: any(p.poll() is None for p in procs[n])
    Simulation._stop_stragglers(sim)  # type: ignore[arg-type]
    assert all(p.poll() is not None for ps in procs.values() for p in ps)  # both terminated
    assert sim.stopped == {"island-1"} and sim.late == {"island-0"}
    # its status (SIGTERM's) is not a failure of the run (a WAN run under load failed so: "workers failed")
    assert procs["island-0"][0].returncode != 0 and Simulation._failures(sim) == []  # type: ignore[arg-type]
    assert [kw["island"] for ev, kw in logged if ev == "worker_stopped"] == ["island-1"]


def test_island_tokens_give_the_coordinator_an_operator_token_for_its_dashboard(tmp_path) -> None:
    """With islands' own tokens the dashboard answers only an operator token: the driver issues one for its
    coordinator (and range shards), owner-only in the run folder, and leaves a token the user set alone."""
    import stat

    from dtrain_cli.simulate_processes import Simulation

    cfg = _cfg(tmp_path)
    var = cfg.security.token_env
    out = tmp_path / "run"
    out.mkdir()
    sim = Simulation(cfg, out, 2, True, {"X": "1"}, False, [], tokens={"island-0": "a", "island-1": "b"})
    token_file = sim.operator_token_file
    assert token_file is not None and token_file.parent == out
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    operator = token_file.read_text().strip()
    assert len(operator) >= 32 and operator not in ("a", "b")
    assert sim.coordinator_env == {"X": "1", var: operator} and sim.env == {"X": "1"}  # islands keep their own
    given = tmp_path / "given"
    given.mkdir()
    kept = Simulation(cfg, given, 2, True, {var: "mine"}, False, [], tokens={"island-0": "a", "island-1": "b"})
    assert kept.operator_token_file is None and kept.coordinator_env == {var: "mine"}
    plain = tmp_path / "plain"
    plain.mkdir()
    assert Simulation(cfg, plain, 2, True, {}, False, []).operator_token_file is None
