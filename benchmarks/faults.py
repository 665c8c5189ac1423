"""Faults: a fault-free `dtrain simulate` next to a chaos run of the same config, in one run.

Both are real process-mode simulations (``dtrain_cli.simulate.run_simulation``: a coordinator and N worker
processes on loopback, 4 islands of configs/small.toml by default, the default heartbeats and lease). The
chaos run injects :data:`FAULTS` (``--fault SPEC``, repeatable, replaces the list; the grammar is in
dtrain_cli/fault_spec.py): an island SIGKILLed and restarted at once (as a supervisor restarts a crashed
process) twice, one hung (SIGSTOP) past its lease, the
coordinator SIGKILLed and resumed once, a poisoned delta, a NaN delta, a slowed link.

Figures, all from the chaos run's summary.json except L:

  I, D   faults injected; of those, detected (``faults[].detected_t`` set: the system noticed them)
  G      goodput: inner steps in merged pushes / inner steps executed by every island process (dtrain/audit.py)
  L      chaos / fault-free final eval loss
  T, U   lost and doubled tokens of the token-range audit (dtrain/audit.py: ranges of a shard no merged push
         covers; ranges merged twice or more)
  X, Y   median and largest detection latency over the detected faults, seconds
  R      median restart time over the chaos run's restarts of a killed island: seconds from the kill to the
         restarted island's first step (the summary's ``restarts``: its ``island_startup`` event, which also
         times each phase of that start; printed per restart). The driver restarts an island the fault's
         seconds after the kill (at once in FAULTS: ``+0s``); the islands share the run's compilation cache
         (``worker.compile_cache``), which their first start filled, so a restart loads its programs.

The kill run (a separate run, :data:`KILL_WALL_FAULT`): island-1 SIGKILLed once version 3 is merged and not
restarted, the other runs' config. Its shard's data left is split across the survivors once their own shards
are done (docs/faults.md, "Segments"), so the run keeps every token:

  K      kill-wall-ratio: the kill run's wall time / the fault-free run's (``--kill-pairs N``: N pairs run one
         after the other, fault-free then kill, and K is the median of their ratios), with its versions and
         lost / doubled tokens (both must be 0). Printed next to it: the bound with every token kept and step
         rounds, (k + (R - k) x n / (n - 1)) / R for a kill at version k of R with n islands (the dead island's
         R - k rounds shared by the n - 1 others), and the fault-free run's utilization.

Targets: D = I; G >= 0.90; L <= 1.02; T = U = 0; a dead (SIGKILLed) island detected in <= 5 s; R <= 8 s; K <= 1.05
(issue 23's; with all data kept the bound above is higher: 1.25 for a kill at v3 of 12 on 4 islands). A missed
target is reported (NOT met) but, as in the other benchmarks, does not change the exit status; a bad
argument or a run that fails does (one line on stderr, exit 2 or 1). Last line:

  faults: injected=I detected=D goodput=G loss-ratio=L lost-tokens=T doubled-tokens=U detect-p50=Xs detect-max=Ys
  restart-p50=Rs kill-wall-ratio=K
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX (in this process and the workers it starts)

from _common import finish, fmt_or_na, log, met

from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain_cli.entry import Parser, run_main
from dtrain_cli.fault_spec import FaultSpec, parse_fault
from dtrain_cli.simulate import run_simulation

# The chaos run, for 4 islands of configs/small.toml (12 versions, ~5 s each on 2 cores after ~40 s of start-up).
FAULTS = (
    "kill:island-1@v1+0s",  # SIGKILL, restarted at once (the first time)
    "slow:island-3@v2+15s,delay=50",  # 50 ms added to every piece of data on island-3's link for 15 s
    "hang:island-2@v3+8s",  # SIGSTOP for 8 s: past the 4 s lease
    "poison:island-0@v4",  # its next push: the real delta x -1000
    "kill-coordinator@v5+2s",  # SIGKILL, restarted with --resume 2 s later
    "nan:island-3@v6",  # its next push carries a NaN
    "kill:island-1@v8+0s",  # SIGKILL, restarted at once (the second time)
)
# The chaos run of a sharded coordinator (--coordinator-shards S > 1): link and push faults are not built with
# shards (docs/architecture.md#shards), so it kills and hangs islands, the lead, and a range shard.
SHARDED_FAULTS = (
    "kill:island-1@v1+0s",  # SIGKILL, restarted at once (the first time)
    "hang:island-2@v3+8s",  # SIGSTOP for 8 s: past the 4 s lease
    "kill-coordinator@v5+2s",  # the lead: SIGKILL, restarted with --resume 2 s later (every shard restored)
    "kill-coordinator@v7+2s,shard=1",  # range shard 1: a failed coordinator, every shard restarted 2 s later
    "kill:island-1@v9+0s",  # SIGKILL, restarted at once (the second time)
)
# The kill run: one island killed once version 3 is merged, never restarted (its data split across the others).
KILL_WALL_FAULT = "kill:island-1@v3"
TARGETS = {"detected": "= injected", "goodput": ">= 0.90", "loss_ratio": "<= 1.02", "lost_tokens": "= 0",
           "doubled_tokens": "= 0", "dead_island_detect_s": "<= 5", "restart_p50_s": "<= 8",
           "kill_wall_ratio": "<= 1.05, 0 lost / 0 doubled"}
GOODPUT_MIN, LOSS_RATIO_MAX, DEAD_ISLAND_DETECT_MAX_S, RESTART_P50_MAX_S = 0.90, 1.02, 5.0, 8.0
KILL_WALL_RATIO_MAX = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/faults.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="config file or name (default: small)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--islands", type=int, default=4, help="islands in both runs (default 4)")
    p.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                   help="a fault of the chaos run (repeatable; replaces the default list, see FAULTS)")
    p.add_argument("--coordinator-shards", type=int, default=1, metavar="S",
                   help="every run with a coordinator of S shard processes (default 1); S > 1 makes the chaos run's "
                   "default faults SHARDED_FAULTS (a range shard killed among them)")
    p.add_argument("--kill-pairs", type=int, default=1, metavar="N",
                   help="fault-free and kill runs for kill-wall-ratio, N pairs one after the other (default 1; "
                        "0: no kill run)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each worker to its share of the CPUs")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each simulation may take (default 1800)")
    p.add_argument("--keep", action="store_true", help="keep both run folders (events, logs, summaries)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.islands < 2:
        p.error("--islands must be >= 2 (one island cannot lose another)")
    if args.kill_pairs < 0:
        p.error(f"--kill-pairs must be >= 0, got {args.kill_pairs}")
    return args


def chaos_faults(texts: list[str] | tuple[str, ...], islands: int) -> list[FaultSpec]:
    """The chaos run's faults, parsed before anything starts (ConfigError names a bad one)."""
    return [parse_fault(text, islands) for text in texts]


def figures(clean: dict[str, Any], chaos: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from the two runs' summaries."""
    faults = chaos["faults"]
    detected = [f for f in faults if f["detected_t"] is not None]
    # A device fault found before its onset time was seen has steps, not seconds (detection_s None): counted as
    # detected, left out of the latencies.
    latencies = [f["detection_s"] for f in detected if f["detection_s"] is not None]
    dead = [f["detection_s"] for f in detected if f["kind"] == "kill" and f["detection_s"] is not None]
    killed = sum(1 for f in faults if f["kind"] == "kill")
    restarts = chaos.get("restarts", [])
    # a restart that never took a step (the run ended first) counts as infinitely slow, not as left out
    restart_p50 = statistics.median(math.inf if r["restart_s"] is None else r["restart_s"] for r in restarts) \
        if restarts else math.inf
    return {
        "injected": len(faults), "detected": len(detected),
        "undetected": [f["fault"] for f in faults if f["detected_t"] is None],
        "goodput": chaos["goodput"], "loss_ratio": chaos["final_eval_loss"] / clean["final_eval_loss"],
        "lost_tokens": chaos["audit"]["lost_tokens"], "doubled_tokens": chaos["audit"]["doubled_tokens"],
        "detect_p50_s": statistics.median(latencies) if latencies else None,
        "detect_max_s": max(latencies) if latencies else None,
        # None when an island was killed but its loss never noticed (counted as a miss), or none was killed
        "dead_island_detect_s": max(dead) if dead and len(dead) == killed else None,
        "islands_killed": killed,
        "restart_p50_s": restart_p50 if math.isfinite(restart_p50) else None,
        "restarts": len(restarts),
    }


def kill_figures(pairs: list[tuple[dict[str, Any], dict[str, Any]]], islands: int, at_version: int) -> dict[str, Any]:
    """kill-wall-ratio from (fault-free, kill) summaries run one after the other: the median of the pairs'
    ratios, each pair's figures, and the bound with every token kept (the module docstring)."""
    rows = []
    for clean, killed in pairs:
        rounds = clean["rounds"]
        bound = (at_version + (rounds - at_version) * islands / (islands - 1)) / rounds
        rows.append({"ratio": killed["wall_s"] / clean["wall_s"], "fault_free_s": clean["wall_s"],
                     "kill_s": killed["wall_s"], "fault_free_versions": rounds, "kill_versions": killed["rounds"],
                     "bound": bound, "lost_tokens": killed["audit"]["lost_tokens"],
                     "doubled_tokens": killed["audit"]["doubled_tokens"],
                     "fault_free_utilization": clean["utilization"], "kill_utilization": killed["utilization"],
                     "segments": killed["audit"].get("segments", {})})
    ratios = [r["ratio"] for r in rows]
    return {"kill_wall_ratio": statistics.median(ratios) if ratios else None, "kill_runs": rows,
            "kill_lost_tokens": sum(r["lost_tokens"] for r in rows),
            "kill_doubled_tokens": sum(r["doubled_tokens"] for r in rows)}


def targets_line(f: dict[str, Any]) -> str:
    g, dead = f["goodput"], f["dead_island_detect_s"]
    checks = [
        (f"detected {f['detected']}/{f['injected']} (target D = I)", f["detected"] == f["injected"]),
        (f"goodput {fmt_or_na(g, '.3f')} (target >= {GOODPUT_MIN:.2f})", None if g is None else g >= GOODPUT_MIN),
        (f"loss-ratio {f['loss_ratio']:.4f} (target <= {LOSS_RATIO_MAX})", f["loss_ratio"] <= LOSS_RATIO_MAX),
        (f"lost-tokens {f['lost_tokens']:,} (target 0)", f["lost_tokens"] == 0),
        (f"doubled-tokens {f['doubled_tokens']:,} (target 0)", f["doubled_tokens"] == 0),
        (f"dead island detected in {fmt_or_na(dead, '.2f', 's')} (target <= {DEAD_ISLAND_DETECT_MAX_S:g}s)",
         None if not f["islands_killed"] else dead is not None and dead <= DEAD_ISLAND_DETECT_MAX_S),
        (f"restart-p50 {fmt_or_na(f['restart_p50_s'], '.2f', 's')} over {f['restarts']} restarts (target <= "
         f"{RESTART_P50_MAX_S:g}s)", None if not f["restarts"] else
         f["restart_p50_s"] is not None and f["restart_p50_s"] <= RESTART_P50_MAX_S),
    ]
    k = f.get("kill_wall_ratio")
    runs = f.get("kill_runs") or []
    lost, doubled = f.get("kill_lost_tokens", 0), f.get("kill_doubled_tokens", 0)
    bound = f" (the bound with all data kept: {runs[0]['bound']:.3f})" if runs else ""
    checks.append((f"kill-wall-ratio {fmt_or_na(k, '.3f')} over {len(runs)} pairs, {lost} lost / {doubled} doubled "
                   f"tokens (target <= {KILL_WALL_RATIO_MAX:g}{bound}, 0 / 0)",
                   None if k is None else k <= KILL_WALL_RATIO_MAX and lost == doubled == 0))
    return "targets: " + "; ".join(f"{what} {met(ok)}" for what, ok in checks)


def final_line(f: dict[str, Any]) -> str:
    return (f"faults: injected={f['injected']} detected={f['detected']} goodput={fmt_or_na(f['goodput'], '.3f')} "
            f"loss-ratio={f['loss_ratio']:.4f} lost-tokens={f['lost_tokens']} doubled-tokens={f['doubled_tokens']} "
            f"detect-p50={fmt_or_na(f['detect_p50_s'], '.2f', 's')} "
            f"detect-max={fmt_or_na(f['detect_max_s'], '.2f', 's')} "
            f"restart-p50={fmt_or_na(f['restart_p50_s'], '.2f', 's')} "
            f"kill-wall-ratio={fmt_or_na(f.get('kill_wall_ratio'), '.3f')}")


def _simulate(cfg: Config, name: str, islands: int, faults: list[FaultSpec], args: argparse.Namespace,
              out_dir: Path) -> dict[str, Any]:
    cfg = replace(cfg, run={"name": name, "out_dir": str(out_dir)})
    t0 = time.perf_counter()
    summary = run_simulation(cfg, islands, quiet=True, pin=not args.no_pin, timeout_s=args.timeout, faults=faults,
                             coordinator_shards=args.coordinator_shards)
    a = summary["audit"]
    log(f"{name}: {summary['rounds']} versions, eval loss {summary['final_eval_loss']:.4f}, goodput "
        f"{fmt_or_na(summary['goodput'], '.3f')}, lost {a['lost_tokens']:,} / doubled {a['doubled_tokens']:,} tokens, "
        f"{a['merged_ranges']} merged ranges, {time.perf_counter() - t0:.0f}s -> {summary['run_dir']}")
    return summary


def _print_faults(chaos: dict[str, Any]) -> None:
    print(f"\n{'fault':<34} {'detected by':<18} {'after':>8}  action; recovery")
    for f in chaos["faults"]:
        after = fmt_or_na(f["detection_s"], ".2f", "s")
        print(f"{f['fault']:<34} {f['detected_by'] or '-':<18} {after:>8}  {f['action']}; "
              f"{f.get('recovery') or 'no recovery'}")
    a = chaos["audit"]
    for kind in ("gaps", "overlaps"):
        if a[kind]:
            print(f"audit {kind}: " + ", ".join(f"shard {r['shard']} [{r['start']}, {r['end']})" for r in a[kind]))
    for r in chaos.get("restarts", ()):
        cpu = r.get("cpu_s") or {}
        phases = ", ".join(f"{p} {s:.2f}" + (f" (CPU {cpu[p]:.2f})" if p in cpu else "")
                           for p, s in (r["phases"] or {}).items())
        after = fmt_or_na(r["restart_s"], ".2f", "s")
        print(f"restart of {r['island']} ({r['fault']}): first step {after} after the kill, restarted "
              f"{r['restarted_t'] - r['killed_t']:.2f}s after it" + (
                  f"; {phases}; compilation cache: {r['cache_hits']} loaded, {r['cache_misses']} compiled"
                  if r["phases"] is not None else "; no step taken"))
    if chaos["unfinished_islands"]:
        print(f"islands that did not finish: {', '.join(chaos['unfinished_islands'])}")
    for f in chaos.get("faults_not_injected", ()):  # not in I: the run did not test it
        print(f"NOT INJECTED: {f['fault']} ({f['reason']})")


def _print_kills(f: dict[str, Any]) -> None:
    for i, r in enumerate(f["kill_runs"], 1):
        split = {k: v for k, v in r["segments"].items() if len(v) > 1}
        print(f"kill pair {i}: fault-free {r['fault_free_s']:.1f}s ({r['fault_free_versions']} versions, "
              f"utilization {r['fault_free_utilization']:.3f}), {KILL_WALL_FAULT} {r['kill_s']:.1f}s "
              f"({r['kill_versions']} versions, utilization {r['kill_utilization']:.3f}, {r['lost_tokens']} lost / "
              f"{r['doubled_tokens']} doubled tokens): ratio {r['ratio']:.3f}, the bound with all data kept "
              f"{r['bound']:.3f}; segments split: "
              + (", ".join(f"shard {k} at {v[1:]}" for k, v in split.items()) or "none"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    faults = chaos_faults(args.faults or (SHARDED_FAULTS if args.coordinator_shards > 1 else FAULTS), args.islands)
    work = Path(tempfile.mkdtemp(prefix="dtrain-faults-"))
    log(f"config {args.config}: {args.islands} islands, {cfg.train.steps} steps x batch {cfg.train.batch_size}, "
        f"H={cfg.outer.inner_steps}, heartbeat {cfg.worker.heartbeat_s:g}s, lease {cfg.coordinator.lease_s:g}s; "
        f"chaos faults: {' '.join(f.text for f in faults)}; runs under {work}")
    kill = parse_fault(KILL_WALL_FAULT, args.islands)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        clean = _simulate(cfg, "fault-free", args.islands, [], args, work)
        if args.kill_pairs:
            pairs.append((clean, _simulate(cfg, "kill-1", args.islands, [kill], args, work)))
        chaos = _simulate(cfg, "chaos", args.islands, faults, args, work)
        for i in range(2, args.kill_pairs + 1):  # fault-free, then kill: the pairs alternate
            pairs.append((_simulate(cfg, f"fault-free-{i}", args.islands, [], args, work),
                          _simulate(cfg, f"kill-{i}", args.islands, [kill], args, work)))
    except DtrainError as e:
        raise DtrainError(f"{e} (run folders kept under {work})") from None
    assert kill.at_version is not None
    result = {**figures(clean, chaos), **kill_figures(pairs, args.islands, kill.at_version)}
    _print_faults(chaos)
    _print_kills(result)
    print(f"\nfault-free: eval loss {clean['final_eval_loss']:.4f}, goodput {fmt_or_na(clean['goodput'], '.3f')}, "
          f"{clean['wall_s']:.0f}s; chaos: eval loss {chaos['final_eval_loss']:.4f}, {chaos['rounds']} versions, "
          f"{chaos['wall_s']:.0f}s" + (f"; undetected: {', '.join(result['undetected'])}" if result["undetected"]
                                        else ""))
    out = {"figures": result, "targets": TARGETS, "faults": list(args.faults or FAULTS), "kill": KILL_WALL_FAULT,
           "fault_free": {k: v for k, v in clean.items() if k != "islands"},
           "chaos": {k: v for k, v in chaos.items() if k != "islands"}}
    finish(out, args.json, work, args.keep, targets_line(result), final_line(result))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/faults.py", main))
