"""Health: chip health inside one island of 8 fake CPU devices: a clean control run next to one run per injected
device fault, and the probes' cost, all in one run.

Every run is a real island: ``workers.app.run_worker`` in this process (one at a time: two in-process workers
break orbax's async checkpointing) against a real coordinator (``coordinator.app.serve``, 127.0.0.1, port 0, in a
child process, see :func:`_start_coordinator`), with ``[health] enabled = true`` and
the default probe intervals (workers/chip_health.py, dtrain/config/ HealthConfig). The config is configs/tiny.toml
with :data:`OVERRIDES`: 16 rows a step (2 per device, so each device's micro-batch gradient is a mean over more
than one row), 1,000 inner steps, one island, 10 rounds of 100 inner steps, a 20 s lease (an island compiling on a
loaded 2-core machine keeps its lease). Each run takes about a minute on 2 CPU cores, the whole benchmark about 10
(``--quick``: 200 steps, two faults, about 4).

The runs: a clean control run (no fault), then one per fault of :data:`FAULTS`, each a
``dtrain.health.faults.DeviceFault`` on a random device (seeded, ``--seed``) from a random inner step ``start`` (the
onset, between 20% and 80% of the run's inner steps; the step is the island's TrainState counter, which keeps counting
across rollbacks). The island finds the device (event ``device_quarantined``, whose evidence ``step`` is the inner
step of the state the probe saw), quarantines it, remeshes on the healthy devices and goes back to its last push.

Figures:

  I, D   faults injected; of those, detected (a ``device_quarantined`` event for the faulty device, at or after
         the fault's onset)
  F      false positives: every device quarantined in the clean run, and every other device (or the faulty one
         before its onset) quarantined in a fault run
  X, Y   median and largest detection delay, in inner steps: the evidence's ``step`` - the fault's ``start``
  P      probe overhead, in percent of the per-device step: the per-device island step with its checks as the
         island runs them, ``ChipHealth.overlap`` after each chunk (the known answer and the replay dispatched
         behind the chunk when their steps come; the chunk before it read: the statistics of its per-device
         gradient norms, its probes' results) and ``ChipHealth.flush`` at the block's end, vs the same per-device
         step without them. Printed beside it, not a target: the same checks read at once
         (``ChipHealth.check`` after each chunk, a host sync before the next chunk is dispatched), timed in the
         same rounds.
         Both on the same ``InnerLoop(cfg, model, mesh, per_device=True)``, after a warm-up that compiled every
         probe (the one-time compile cost is printed, not in P). ``--repeats`` rounds, each one timed block (whole
         probe intervals, >= 200 steps) of the fused step, the per-device step and the per-device step with the
         probes, the order alternating from round to round; P is the median of the rounds' ratios, printed with
         their range (min..max): on a loaded machine the blocks of one round see about the same load.
  R      the per-device step's time / the fused step's (``per_device=False``), the same way: the price of the
         per-device step itself (each device's own gradient in hand, then an explicit mean), NOT part of P
  L      the largest, over the fault runs, of (that run's final eval loss / the clean run's); every island's
         final eval loss is its summary's ``final_eval_loss`` (the final global θ on the fixed eval batches)

Targets: D = I; F = 0; Y <= 50 inner steps; P <= 3%; R <= 1.05; L <= 1.01; and a clean run of >= 1,000 inner
steps. A missed target is reported (NOT met) but, as in the other benchmarks, does not change the exit status; a
bad argument or a run that fails does (one line on stderr, exit 2 or 1). Last line:

  health: injected=I detected=D false-positives=F detect-steps-p50=X detect-steps-max=Y probe-overhead=P%
          per-device-ratio=R loss-ratio=L   (one line)

``--timing-only``: P and R alone (no island runs; e.g. ``--config small --repeats 5``), last line
``health-timing: probe-overhead=P% per-device-ratio=R repeats=N``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

N_DEVICES = 8
_DEVICES_FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts: XLA reads it once
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _common import finish, fmt_or_na, log, met  # noqa: E402

from dtrain.config.load import (
    load_config,  # noqa: E402
    replace,
    to_toml,
)
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import DtrainError  # noqa: E402
from dtrain.health.faults import DeviceFault  # noqa: E402
from dtrain_cli.entry import Parser, run_main  # noqa: E402

# configs/tiny.toml plus these (then --set): see the module's docstring.
OVERRIDES = ("train.batch_size=16", "train.steps=1000", "outer.islands=1", "outer.inner_steps=100",
             "health.enabled=true", "coordinator.lease_s=20", "worker.start_wait_s=0")
QUICK_OVERRIDES = ("train.steps=200", "outer.inner_steps=50")
CLEAN_STEPS_MIN = 1000
DETECT_STEPS_MAX, PROBE_OVERHEAD_MAX, LOSS_RATIO_MAX = 50, 0.03, 1.01
PER_DEVICE_RATIO_MAX = 1.05  # the per-device step's time / the fused step's
START_TIMEOUT_S = 120.0  # the coordinator's start (θ_0 is computed in a child of it)
ONSET_RANGE = (0.2, 0.8)  # the onset: a random inner step in this fraction of the run's steps
TARGETS = {"detected": "= injected", "false_positives": "= 0", "detect_steps_max": f"<= {DETECT_STEPS_MAX}",
           "probe_overhead": f"<= {PROBE_OVERHEAD_MAX:.0%}", "per_device_ratio": f"<= {PER_DEVICE_RATIO_MAX}",
           "loss_ratio": f"<= {LOSS_RATIO_MAX}",
           "clean_steps": f">= {CLEAN_STEPS_MIN}"}


@dataclass(frozen=True)
class FaultKind:
    name: str
    what: str  # for the table's footnote
    make: Callable[[int, int, int], DeviceFault]  # (device id, onset step, seed) -> the fault


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("scale", "outputs x10 on every step",
              lambda d, start, seed: DeviceFault("scale", d, factor=10.0, start=start, seed=seed)),
    FaultKind("bitflip-exp", "bit 30 (exponent) of every float flipped: huge or non-finite",
              lambda d, start, seed: DeviceFault("bitflip", d, bit=30, start=start, seed=seed)),
    FaultKind("bitflip-mantissa", "bit 22 (mantissa) of every float flipped: silent, finite",
              lambda d, start, seed: DeviceFault("bitflip", d, bit=22, start=start, seed=seed)),
    FaultKind("intermittent", "outputs x10 on 30% of steps (prob=0.3)",
              lambda d, start, seed: DeviceFault("scale", d, factor=10.0, prob=0.3, start=start, seed=seed)),
    FaultKind("dead", "its computations raise",
              lambda d, start, seed: DeviceFault("dead", d, start=start, seed=seed)),
)
QUICK_FAULTS = ("scale", "dead")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/health.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="config file or name (default: tiny, with OVERRIDES)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable; after OVERRIDES)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run for a smoke test: {' '.join(QUICK_OVERRIDES)}, faults {','.join(QUICK_FAULTS)}, "
                        "2 timing repeats")
    p.add_argument("--faults", default=None, metavar="NAME,...",
                   help=f"the faults to inject, from {','.join(f.name for f in FAULTS)} (default: all; --quick: "
                        f"{','.join(QUICK_FAULTS)})")
    p.add_argument("--seed", type=int, default=0, help="seeds the faults' devices, onsets and draws (default 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed blocks of each kind (default 7; --quick: 2)")
    p.add_argument("--timing-only", action="store_true",
                   help="only the step times (fused, per-device, per-device + probes), no island runs")
    p.add_argument("--keep", action="store_true", help="keep the run folders (events, summaries)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    names = [f.name for f in FAULTS]
    args.fault_names = (args.faults.split(",") if args.faults is not None else
                        list(QUICK_FAULTS) if args.quick else names)
    unknown = [n for n in args.fault_names if n not in names]
    if unknown or not args.fault_names or len(set(args.fault_names)) != len(args.fault_names):
        p.error(f"--faults {args.faults!r}: give distinct names from {','.join(names)}")
    if args.repeats is None:
        args.repeats = 2 if args.quick else 7
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def bench_config(args: argparse.Namespace) -> Config:
    """The config of every run: ``--config`` with OVERRIDES (and QUICK_OVERRIDES), then ``--set``."""
    return load_config(args.config, [*OVERRIDES, *(QUICK_OVERRIDES if args.quick else ()), *args.overrides])


# ---------------------------------------------------------------------------------------------- plans and figures


def plan_faults(names: Sequence[str], steps: int, seed: int, device_ids: Sequence[int]
                ) -> list[tuple[str, DeviceFault]]:
    """One fault per name, each on a random device of ``device_ids`` from a random onset in ``ONSET_RANGE`` of
    ``steps`` (seeded: the same plan for the same seed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lo, hi = int(ONSET_RANGE[0] * steps), max(int(ONSET_RANGE[1] * steps), int(ONSET_RANGE[0] * steps) + 1)
    by_name = {f.name: f for f in FAULTS}
    out = []
    for name in names:
        device = int(device_ids[int(rng.integers(len(device_ids)))])
        onset = int(rng.integers(lo, hi + 1))
        out.append((name, by_name[name].make(device, onset, int(rng.integers(2**31)))))
    return out


def run_record(fault_name: str, fault: DeviceFault | None, events: list[dict[str, Any]],
               summary: dict[str, Any]) -> dict[str, Any]:
    """One run's row from its island's events and summary: what was quarantined (device, probe, step), whether
    (and how many steps after its onset) the fault was found, and its false positives."""
    quarantined = [{"device": e["device"], "probe": e["probe"], "step": e["step"], "detail": e.get("detail", ""),
                    **{k: e[k] for k in ("value", "expected", "z", "median") if k in e}}
                   for e in events if e.get("event") == "device_quarantined"]
    found = None
    false_positives = []
    for q in quarantined:
        if fault is not None and fault.found_by(q) and found is None:
            found = q
        else:  # the clean run's, another device, or the faulty one before its fault began
            false_positives.append(q)
    return {
        "fault": fault_name, "kind": fault.kind if fault else None, "device": fault.device if fault else None,
        "onset": fault.start if fault else None, "spec": _fault_spec(fault) if fault else None,
        "detected": found is not None, "detected_step": found["step"] if found else None,
        "probe": found["probe"] if found else None,
        "detect_steps": found["step"] - fault.start if found and fault else None,
        "quarantined": quarantined, "false_positives": len(false_positives),
        "final_eval_loss": float(summary["final_eval_loss"]), "steps": int(summary["steps"]),
        "devices_left": int(summary["devices"]), "nan_rollbacks": int(summary.get("nan_rollbacks", 0)),
        "remeshes": sum(1 for e in events if e.get("event") == "remeshed"),
        "wall_s": float(summary.get("wall_s", 0.0)),
    }


def _fault_spec(f: DeviceFault) -> dict[str, Any]:
    return {"kind": f.kind, "device": f.device, "prob": f.prob, "factor": f.factor, "bit": f.bit, "start": f.start,
            "seed": f.seed}


def figures(clean: dict[str, Any], runs: list[dict[str, Any]], timing: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from the clean run's record, the fault runs' records and the timing."""
    delays = [r["detect_steps"] for r in runs if r["detected"]]
    base = clean["final_eval_loss"]
    ratios = [r["final_eval_loss"] / base for r in runs]
    return {
        "injected": len(runs), "detected": len(delays),
        "undetected": [r["fault"] for r in runs if not r["detected"]],
        "false_positives": clean["false_positives"] + sum(r["false_positives"] for r in runs),
        "detect_steps_p50": statistics.median(delays) if delays else None,
        "detect_steps_max": max(delays) if delays else None,
        "probe_overhead": timing["probe_overhead"], "per_device_overhead": timing["per_device_overhead"],
        "probe_overhead_range": timing.get("probe_overhead_range"),
        "per_device_overhead_range": timing.get("per_device_overhead_range"),
        # any non-finite ratio (a run that ended without a final eval) makes L non-finite: not met
        "loss_ratios": dict(zip((r["fault"] for r in runs), ratios, strict=True)),
        "loss_ratio": (max(ratios) if all(math.isfinite(x) for x in ratios) else math.nan) if ratios else None,
        "clean_steps": clean["steps"],
    }


def _spread(f: dict[str, Any], key: str, ratio: bool = False) -> str:
    """`` (range lo..hi)`` of an overhead's per-repeat values, as percent (or as a ratio), or nothing."""
    r = f.get(f"{key}_range")
    if not r:
        return ""
    return f" (range {1 + r[0]:.3f}..{1 + r[1]:.3f})" if ratio else f" (range {r[0]:+.1%}..{r[1]:+.1%})"


def timing_checks(f: dict[str, Any]) -> list[tuple[str, bool | None]]:
    """The targets on the step times: the probes' overhead and the per-device step's ratio to the fused one."""
    p, d = f["probe_overhead"], 1.0 + f["per_device_overhead"]
    return [(f"probe-overhead {p:.1%}{_spread(f, 'probe_overhead')} (target <= {PROBE_OVERHEAD_MAX:.0%})",
             p <= PROBE_OVERHEAD_MAX),
            (f"per-device-ratio {d:.3f}{_spread(f, 'per_device_overhead', True)} (target <= {PER_DEVICE_RATIO_MAX})",
             d <= PER_DEVICE_RATIO_MAX)]


def targets_line(f: dict[str, Any]) -> str:
    y, lr = f["detect_steps_max"], f["loss_ratio"]
    checks = [
        (f"detected {f['detected']}/{f['injected']} (target D = I)", f["detected"] == f["injected"]),
        (f"false-positives {f['false_positives']} (target 0)", f["false_positives"] == 0),
        (f"detect-steps-max {fmt_or_na(y, 'd')} (target <= {DETECT_STEPS_MAX})",
         None if not f["injected"] else y is not None and y <= DETECT_STEPS_MAX and f["detected"] == f["injected"]),
        *timing_checks(f),
        (f"loss-ratio {fmt_or_na(lr, '.4f')} (target <= {LOSS_RATIO_MAX})",
         None if lr is None else lr <= LOSS_RATIO_MAX),  # a nan ratio compares False: NOT met
        (f"clean run {f['clean_steps']} inner steps (target >= {CLEAN_STEPS_MIN})",
         f["clean_steps"] >= CLEAN_STEPS_MIN),
    ]
    return "targets: " + "; ".join(f"{what} {met(ok)}" for what, ok in checks)


def final_line(f: dict[str, Any]) -> str:
    p50 = f["detect_steps_p50"]
    return (f"health: injected={f['injected']} detected={f['detected']} false-positives={f['false_positives']} "
            f"detect-steps-p50={fmt_or_na(p50, 'g')} detect-steps-max={fmt_or_na(f['detect_steps_max'], 'd')} "
            f"probe-overhead={f['probe_overhead']:.1%} per-device-ratio={1 + f['per_device_overhead']:.3f} "
            f"loss-ratio={fmt_or_na(f['loss_ratio'], '.4f')}")


def timing_line(f: dict[str, Any]) -> str:
    """The last line of ``--timing-only``."""
    return (f"health-timing: probe-overhead={f['probe_overhead']:.1%} "
            f"per-device-ratio={1 + f['per_device_overhead']:.3f} repeats={f['repeats']}")


def table(clean: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """The runs as text rows (the clean run first)."""
    head = (f"{'fault':<17} {'device':>6} {'onset':>6} {'found at':>8} {'probe':<13} {'delay':>5}  "
            f"{'quarantined':<36} {'eval loss':>9} {'ratio':>7}")
    rows = [head]
    for r in [clean, *runs]:
        ratio = r["final_eval_loss"] / clean["final_eval_loss"] if r is not clean else None
        q = ", ".join(f"{x['device']}@{x['step']}({x['probe']})" for x in r["quarantined"]) or "-"
        rows.append(f"{r['fault']:<17} {fmt_or_na(r['device'], 'd'):>6} {fmt_or_na(r['onset'], 'd'):>6} "
                    f"{fmt_or_na(r['detected_step'], 'd'):>8} {r['probe'] or '-':<13} "
                    f"{fmt_or_na(r['detect_steps'], 'd'):>5}  "
                    f"{q:<36} {r['final_eval_loss']:>9.4f} {fmt_or_na(ratio, '.4f'):>7}")
    return rows


# ---------------------------------------------------------------------------------------------- the runs


def island_run(cfg: Config, work: Path, name: str, fault_name: str, fault: DeviceFault | None,
               timeout_s: float) -> dict[str, Any]:
    """One coordinator (a child process) and one island worker in this process (with ``fault``) to the end of the
    run; the run's record."""
    from dtrain.runlog import read_events
    from workers.app import run_worker

    run_dir = work / name
    run_dir.mkdir(parents=True)
    cfg = replace(cfg, run={"name": name, "out_dir": str(run_dir)})
    t0 = time.perf_counter()
    coordinator = _start_coordinator(cfg, run_dir)
    try:
        port = _coordinator_port(coordinator, run_dir, timeout_s)
        summary = run_worker(cfg, f"127.0.0.1:{port}", "island-0", run_dir / "island-0", quiet=True,
                             device_fault=fault)
        assert coordinator.stdin is not None
        coordinator.stdin.close()  # the island has returned: the coordinator stops
        try:
            coordinator.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise DtrainError(f"run {name}: the coordinator did not stop after the run (log: "
                              f"{run_dir / 'coordinator.log'})") from None
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    if "final_eval_loss" not in summary:
        raise DtrainError(f"run {name}: the island did not train ({summary})")
    record = run_record(fault_name, fault, read_events(run_dir / "island-0"), summary)
    q = ", ".join(f"device {x['device']} by {x['probe']} at step {x['step']}" for x in record["quarantined"])
    log(f"{name}: {record['steps']} inner steps on {record['devices_left']} devices, eval loss "
        f"{record['final_eval_loss']:.4f}, quarantined: {q or 'none'}, {time.perf_counter() - t0:.0f}s")
    return record


# The coordinator's child process: serve() on port 0 until its stdin closes (the island has returned).
_COORDINATOR = """
import json, sys
from pathlib import Path
from coordinator.app import serve
from coordinator.lifecycle import initial_parameters
from dtrain.config.load import load_config
cfg, run_dir = load_config(sys.argv[1]), Path(sys.argv[2])
theta, spec = initial_parameters(cfg)
server, service, port = serve(cfg, run_dir, theta, spec, port=0, quiet=True)
(run_dir / "port.tmp").write_text(json.dumps({"port": port}))
(run_dir / "port.tmp").replace(run_dir / "coordinator.json")
sys.stdin.read()
server.stop(grace=None).wait()
service.close()
"""


def _start_coordinator(cfg: Config, run_dir: Path) -> subprocess.Popen[bytes]:
    """The run's coordinator (``coordinator.app.serve`` on 127.0.0.1, port 0) in a child process, which serves
    until its stdin is closed (as the in-process tests' coordinator is stopped once the island returns: a
    ``dtrain coordinator`` that stops by itself when the run is over can cut the island's last call short).
    Not in this process: orbax numbers checkpoint saves by one operation id per process, and a coordinator and a
    worker in one process that save at the same moment can leave a save waiting for the other's signal (seen here:
    a 300 s timeout, then the worker failing)."""
    (run_dir / "config.toml").write_text(to_toml(cfg))
    (run_dir / "coordinator").mkdir()
    with open(run_dir / "coordinator.log", "wb") as out:  # the child imports the installed package, as we do
        return subprocess.Popen([sys.executable, "-c", _COORDINATOR, str(run_dir / "config.toml"),
                                 str(run_dir / "coordinator")], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT)


def _coordinator_port(proc: subprocess.Popen[bytes], run_dir: Path, timeout_s: float) -> int:
    info = run_dir / "coordinator" / "coordinator.json"
    t0 = time.perf_counter()
    see = f"see {run_dir / 'coordinator.log'}"
    while not info.exists():
        if proc.poll() is not None:
            raise DtrainError(f"the coordinator exited with status {proc.returncode}; {see}")
        if time.perf_counter() - t0 > timeout_s:
            raise DtrainError(f"the coordinator did not start within {timeout_s:.0f}s; {see}")
        time.sleep(0.1)
    return int(json.loads(info.read_text())["port"])


# ---------------------------------------------------------------------------------------------- the probes' cost


def probe_timing(cfg: Config, repeats: int, seed: int) -> dict[str, Any]:
    """Seconds per inner step of the fused step, the per-device step, and the per-device step with
    ``ChipHealth.check`` after each chunk, in ``repeats`` rounds of one timed block of each kind (their order
    alternating from round to round); the medians, and the two overheads as the median and the range of the
    rounds' ratios; see the module's docstring."""
    import jax
    import numpy as np

    from dtrain.models import model
    from dtrain.steps.inner import make_mesh
    from dtrain.train.loop import InnerLoop
    from workers.chip_health import ChipHealth

    built = model.build(cfg.model)
    mesh = make_mesh(cfg)
    K, B, L1 = cfg.train.steps_per_call, cfg.train.batch_size, cfg.model.seq_len + 1
    h = cfg.health
    # A block covers whole probe intervals (so each block runs its share of known answers and replays), >= 200 steps.
    period = math.lcm(K, h.known_answer_every or K, h.replay_every or K)
    block_chunks = period * max(1, math.ceil(200 / period)) // K
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, cfg.model.vocab_size, (K, B, L1), dtype=np.int32) for _ in range(4)]
    params = built.init(cfg.run.seed)
    fused = InnerLoop(cfg, built, mesh, per_device=False)
    per_device = InnerLoop(cfg, built, mesh, per_device=True)
    health = ChipHealth(h, built.apply, mesh)
    at_once = ChipHealth(h, built.apply, mesh)  # the same checks, each chunk's read before the next is dispatched
    states = {"fused": fused.init_state(params), "per_device": per_device.init_state(params)}

    def block(kind: str, chunks: int) -> float:
        loop = fused if kind == "fused" else per_device
        state = states["fused" if kind == "fused" else "per_device"]
        t0 = time.perf_counter()
        for i in range(chunks):
            batches = pool[i % len(pool)]
            if kind == "at_once":  # the checks not overlapped (before they were): a host sync per chunk
                first = int(state.step)
                state, metrics = loop.run(state, batches)
                at_once.check(first, metrics, state.params, batches)
            elif kind == "probes":  # as the island does: the chunk, its probes dispatched, the last chunk's read
                first = health.next_step if health.next_step is not None else int(state.step)
                state, metrics = loop.run(state, batches)
                health.overlap(first, metrics, state.params, batches)
            else:
                state, _ = loop.run(state, batches)
        if kind == "probes":  # as the island before a push: the last chunk's check read
            health.flush(state.params)
        jax.block_until_ready(state)
        states["fused" if kind == "fused" else "per_device"] = state
        return (time.perf_counter() - t0) / (chunks * K)

    t0 = time.perf_counter()
    block("fused", 1)
    block("per_device", 1)  # compiled both steps
    compile_steps_s = time.perf_counter() - t0
    # Warm-up with the probes until the replay has run (its one program over the mesh compiles on first use); the
    # known answer compiles in start().
    warm_chunks = max(block_chunks, math.ceil((h.replay_every or K) / K) + 1)
    t0 = time.perf_counter()
    health.start(0)
    at_once.start(0)
    warm_s = time.perf_counter() - t0 + block("probes", warm_chunks) * warm_chunks * K
    block("at_once", warm_chunks)
    log(f"timing: steps compiled in {compile_steps_s:.1f}s; probes warmed up over {warm_chunks * K} steps "
        f"({warm_s:.1f}s); {repeats} x {block_chunks * K}-step blocks of each kind")
    times: dict[str, list[float]] = {"fused": [], "per_device": [], "probes": [], "at_once": []}
    for r in range(repeats):
        order = ("fused", "per_device", "probes", "at_once")
        for kind in (order if r % 2 == 0 else order[::-1]):
            times[kind].append(block(kind, block_chunks))
        log(f"timing: repeat {r + 1}/{repeats}: fused {times['fused'][-1] * 1e3:.3f} ms/step, per-device "
            f"{times['per_device'][-1] * 1e3:.3f}, per-device + probes {times['probes'][-1] * 1e3:.3f} (read at "
            f"once {times['at_once'][-1] * 1e3:.3f})")
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each repeat's ratios (its blocks ran side by side): their median, and their spread (min, max)
    probe_r = [p / d - 1.0 for p, d in zip(times["probes"], times["per_device"], strict=True)]
    at_once_r = [p / d - 1.0 for p, d in zip(times["at_once"], times["per_device"], strict=True)]
    device_r = [d / f - 1.0 for d, f in zip(times["per_device"], times["fused"], strict=True)]
    if health.quarantined:  # healthy fake devices: a probe that flags one here is a false positive too
        log(f"WARNING: the timing's probes quarantined {health.bad_devices} (healthy devices)")
    return {
        "fused_step_s": med["fused"], "per_device_step_s": med["per_device"], "probes_step_s": med["probes"],
        "probe_overhead": statistics.median(probe_r), "probe_overhead_range": [min(probe_r), max(probe_r)],
        "probe_overhead_at_once": statistics.median(at_once_r),
        "probe_overhead_at_once_range": [min(at_once_r), max(at_once_r)],
        "per_device_overhead": statistics.median(device_r),
        "per_device_overhead_range": [min(device_r), max(device_r)],
        "probes_one_time_s": max(0.0, warm_s - warm_chunks * K * med["probes"]),
        "block_steps": block_chunks * K, "repeats": repeats, "samples_s": times,
        "probe_calls": dict(health.probe_calls), "timing_quarantined": health.bad_devices,
    }


# ---------------------------------------------------------------------------------------------- main


def print_timing(t: dict[str, Any]) -> None:
    """The step times and the two overheads (median of the repeats' ratios, and their range)."""
    print(f"step time, median of {t['repeats']} alternating {t['block_steps']}-step blocks each: "
          f"fused {t['fused_step_s'] * 1e3:.3f} ms, per-device {t['per_device_step_s'] * 1e3:.3f} ms, "
          f"per-device + probes {t['probes_step_s'] * 1e3:.3f} ms")
    print(f"probe overhead (per-device + probes vs per-device, the target's P), median of the {t['repeats']} "
          f"repeats' ratios: {t['probe_overhead']:+.1%}{_spread(t, 'probe_overhead')}; probes' one-time compile "
          f"{t['probes_one_time_s']:.1f}s (not in P)")
    if "probe_overhead_at_once" in t:  # side by side: the same checks, each chunk's read before the next runs
        print(f"the same checks not overlapped (each chunk read before the next is dispatched; not in P): "
              f"{t['probe_overhead_at_once']:+.1%}{_spread(t, 'probe_overhead_at_once')}")
    print(f"per-device step vs fused step (the per-device step's own price, NOT in P), median of the repeats' "
          f"ratios: {1 + t['per_device_overhead']:.3f}x{_spread(t, 'per_device_overhead', True)}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = bench_config(args)
    if cfg.outer.islands != 1:
        raise ConfigError(f"[outer] islands: this benchmark runs one island, got {cfg.outer.islands}")
    if not cfg.health.enabled:
        raise ConfigError("[health] enabled: this benchmark measures chip health; it must stay true")
    import jax

    device_ids = [int(d.id) for d in jax.devices()]
    if len(device_ids) != N_DEVICES:
        print(f"error: {len(device_ids)} JAX devices; this benchmark needs an island of {N_DEVICES} "
              f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})",
              file=sys.stderr)
        raise SystemExit(2)
    plan = plan_faults(args.fault_names, cfg.train.steps, args.seed, device_ids)
    work = Path(tempfile.mkdtemp(prefix="dtrain-health-"))
    h = cfg.health
    log(f"config {args.config}: {cfg.train.steps} steps x batch {cfg.train.batch_size} on {N_DEVICES} devices, "
        f"{cfg.train.steps_per_call} steps a chunk, H={cfg.outer.inner_steps}; probes: known answer every "
        f"{h.known_answer_every}, stats {'on' if h.stats else 'off'} (z_max {h.z_max:g}), replay every "
        f"{h.replay_every}; faults: " + ", ".join(f"{n} on device {f.device} from step {f.start}" for n, f in plan)
        + f"; runs under {work}")
    try:
        timing = probe_timing(cfg, args.repeats, args.seed)
        log(f"timing: fused {timing['fused_step_s'] * 1e3:.2f} ms/step, per-device "
            f"{timing['per_device_step_s'] * 1e3:.2f}, per-device + probes {timing['probes_step_s'] * 1e3:.2f}: "
            f"probes {timing['probe_overhead']:+.1%}")
        if args.timing_only:
            print_timing(timing)
            out = {"timing": timing, "targets": {k: TARGETS[k] for k in ("probe_overhead", "per_device_ratio")},
                   "config": {"name": args.config, "overrides": [*OVERRIDES, *(QUICK_OVERRIDES if args.quick else
                                                                                ()), *args.overrides]}}
            finish(out, args.json, work, args.keep,
                   "targets: " + "; ".join(f"{what} {met(ok)}" for what, ok in timing_checks(timing)),
                   timing_line(timing))
            return out
        clean = island_run(cfg, work, "clean", "none (clean)", None, START_TIMEOUT_S)
        runs = []
        for i, (name, fault) in enumerate(plan):
            log(f"run {i + 1}/{len(plan)}: {name} on device {fault.device} from step {fault.start}")
            runs.append(island_run(cfg, work, f"{i + 1}-{name}", name, fault, START_TIMEOUT_S))
    except DtrainError as e:
        raise DtrainError(f"{e} (run folders kept under {work})") from None
    result = figures(clean, runs, timing)
    print()
    print("\n".join(table(clean, runs)))
    by_name = {f.name: f.what for f in FAULTS}
    print("faults: " + "; ".join(f"{n}: {by_name[n]}" for n, _ in plan))
    print()
    print_timing(timing)
    if result["undetected"]:
        print(f"undetected: {', '.join(result['undetected'])}")
    out = {"figures": result, "targets": TARGETS, "seed": args.seed, "quick": args.quick,
           "config": {"name": args.config, "overrides": [*OVERRIDES, *(QUICK_OVERRIDES if args.quick else ()),
                                                         *args.overrides]},
           "clean": clean, "runs": runs, "timing": timing}
    finish(out, args.json, work, args.keep, targets_line(result), final_line(result))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/health.py", main))
