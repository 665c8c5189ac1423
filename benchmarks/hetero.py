"""Heterogeneous islands: identical islands next to islands that differ, in step rounds and in auto wall-time rounds.

Three real process-mode simulations (``dtrain_cli.simulate.run_simulation``, configs/small.toml by default), in
one invocation on one machine, all with the same total tokens:

  (a) identical   4 islands of batch B (--batches' first, 32) on D fake CPU devices each, full speed, step rounds
                  of H steps (``outer.inner_steps``), R rounds (``train.steps`` = R x H).
  (b) steps       4 islands that differ (``--island``): batch sizes 32, 32, 16, 8 on 4, 4, 2, 1 devices
                  (``--batches``, ``--devices``) and speeds 1, 1, 1/2, 1/4 (``--speeds``: slowdown = 1 / speed,
                  a sleep after each chunk of (K-1) x its measured compute time, dtrain_cli/island_spec.py);
                  ``train.base_batch_size`` = B, so every shard holds R x H x B sequences and each island takes
                  R x H x B / its batch steps; step rounds of H steps of B sequences (each round the same
                  tokens per island: the slow islands make the others wait).
  (c) auto        the islands of (b) with ``worker.round_seconds = auto``: a round lasts as long as the islands,
                  at their measured token rates, take together for the tokens of H steps of B sequences per
                  island (auto_round_seconds), each island training for the round's wall time at its own speed,
                  its pushes weighted by their tokens; R rounds, so the same total tokens as (a) and (b) (to
                  within the rates' drift after round 1 and round 1 itself, which lasts until every island has
                  timed a chunk: the slow islands get ``train.steps_per_call`` x speed, at least 4, to keep it
                  short): the same number of outer steps on the same tokens, so the loss compares. Each island
                  stretches its lr schedule to the steps it takes at its own rate (workers/pacing.py), with no
                  recompilation (the schedule is an input of the step).

Per run: wall time (the longest island's training time, start-up and compilation left out), each island's
utilization (time in inner steps / training wall time, the summary's ``utilization``), tokens per island and the
final eval loss. Figures:

  A   util-min-steps: the lowest island utilization of (b), the straggler cost of step rounds (reported)
  B   util-min-auto: the lowest island utilization of (c); target >= 0.97
  C   loss-ratio-auto: (c) / (a) final eval loss; target <= 1.02
  D   wall-ratio-auto: (c)'s wall time / the wall time the same islands would need at their own speeds with
      no waiting: (c)'s tokens / the sum of every island's measured rate (its tokens / its time in steps)

A missed target is reported (NOT met) but does not change the exit status; a bad argument or a run that fails
does (one line on stderr, exit 2 or 1). Last line:

  hetero: util-min-steps=A util-min-auto=B loss-ratio-auto=C wall-ratio-auto=D
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX (in this process and the workers it starts)

from _common import finish, fmt_or_na, log, met

from dtrain.config.load import load_config, replace
from dtrain.config.sections import ROUND_AUTO, Config
from dtrain.errors import DtrainError
from dtrain_cli.entry import Parser, run_main
from dtrain_cli.island_spec import parse_islands
from dtrain_cli.simulate import run_simulation

TARGETS = {"util_min_auto": ">= 0.97", "loss_ratio_auto": "<= 1.02", "util_min_steps": "reported"}
UTIL_MIN, LOSS_RATIO_MAX = 0.97, 1.02


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None
    if not out or not all(0 < x <= 1 for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: speeds are in (0, 1]")
    return out


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/hetero.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="config file or name (default: small)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--speeds", type=_floats, default=[1.0, 1.0, 0.5, 0.25], help="islands' speeds (default "
                   "1,1,0.5,0.25)")
    p.add_argument("--batches", type=_ints, default=[32, 32, 16, 8], help="islands' batch sizes; the first is (a)'s "
                   "and the run's base batch (default 32,32,16,8)")
    p.add_argument("--devices", type=_ints, default=[4, 4, 2, 1], help="islands' fake CPU devices; the first is "
                   "(a)'s (default 4,4,2,1)")
    p.add_argument("--inner-steps", type=int, default=20, help="H: steps of the base batch per step round "
                   "(default 20)")
    p.add_argument("--rounds", type=int, default=11, help="R: step rounds of (a) and (b) (default 11)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each worker to its share of the CPUs")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each simulation may take (default 3600)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (events, logs, summaries)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if not len(args.speeds) == len(args.batches) == len(args.devices) >= 2:
        p.error("--speeds, --batches and --devices need one value per island, at least 2 islands")
    if args.inner_steps < 1 or args.rounds < 1:
        p.error("--inner-steps and --rounds must be >= 1")
    return args


def plan(cfg: Config, args: argparse.Namespace) -> dict[str, tuple[Config, list[str]]]:
    """The three runs: each one's config and ``--island`` specs (checked here, before anything starts)."""
    n, base, h, r = len(args.speeds), args.batches[0], args.inner_steps, args.rounds
    common = {"train": {"batch_size": base, "base_batch_size": base, "steps": r * h}, "outer": {"inner_steps": h}}
    warmup = min(cfg.train.warmup_steps, r * h - 1)
    cfg = replace(cfg, train={**common["train"], "warmup_steps": warmup}, outer=common["outer"])
    same = [f"island-{i}:host_devices={args.devices[0]}" for i in range(n)]
    # short chunks for the slow islands, so that auto's round 1 (which lasts until every island has timed a
    # chunk) is not long
    per_call = [max(min(cfg.train.steps_per_call, round(cfg.train.steps_per_call * sp)), 4) for sp in args.speeds]
    differ = [f"island-{i}:train.batch_size={b},host_devices={d},slowdown={1 / sp:g}"
              + (f",train.steps_per_call={k}" if k != cfg.train.steps_per_call else "")
              for i, (b, d, sp, k) in enumerate(zip(args.batches, args.devices, args.speeds, per_call, strict=True))]
    # auto rounds carry H base steps per island (the islands' rates measured, whatever they are): R of them train
    # (a)'s tokens; the lr schedules are stretched per island (workers.pacing.retimed)
    auto = replace(cfg, worker={"round_seconds": ROUND_AUTO})
    runs = {"identical": (cfg, same), "steps": (cfg, differ), "auto": (auto, differ)}
    for run_cfg, specs in runs.values():
        parse_islands(specs, n, run_cfg)
    return runs


def _simulate(name: str, cfg: Config, specs: list[str], islands: int, args: argparse.Namespace,
              out_dir: Path) -> dict[str, Any]:
    cfg = replace(cfg, run={"name": name, "out_dir": str(out_dir)})
    t0 = time.perf_counter()
    summary = run_simulation(cfg, islands, quiet=True, pin=not args.no_pin, timeout_s=args.timeout,
                             island_specs=parse_islands(specs, islands, cfg))
    r = run_figures(summary)
    log(f"{name}: {summary['rounds']} versions, eval loss {summary['final_eval_loss']:.4f}, "
        f"{summary['tokens']:,} tokens, training wall {r['wall_s']:.1f}s, utilization min {r['util_min']:.3f}, "
        f"lost {summary['audit']['lost_tokens']:,} / doubled {summary['audit']['doubled_tokens']:,} tokens, "
        f"{time.perf_counter() - t0:.0f}s -> {summary['run_dir']}")
    return summary


def run_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its summary: training wall time (the longest island's time in its training loop),
    utilization per island, tokens per island, the eval loss, and the ideal wall time (its tokens over the sum of
    the islands' rates, each its tokens / its time in inner steps)."""
    islands = sorted(summary["islands"], key=lambda s: s["island"])
    wall = max(s["active_s"] for s in islands)
    rates = [s["tokens"] / max(s["active_s"] * s["utilization"], 1e-9) for s in islands]
    return {"wall_s": wall, "util": {s["island"]: s["utilization"] for s in islands},
            "util_min": min(s["utilization"] for s in islands),
            "tokens": {s["island"]: s["tokens"] for s in islands}, "total_tokens": summary["tokens"],
            "steps": {s["island"]: s["steps"] for s in islands},
            "eval_loss": summary["final_eval_loss"], "ideal_wall_s": summary["tokens"] / sum(rates),
            "versions": summary["rounds"], "audit": {k: summary["audit"][k] for k in ("lost_tokens",
                                                                                     "doubled_tokens")}}


def figures(identical: dict[str, Any], steps: dict[str, Any], auto: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from the three runs' :func:`run_figures`."""
    return {"util_min_steps": steps["util_min"], "util_min_auto": auto["util_min"],
            "loss_ratio_auto": auto["eval_loss"] / identical["eval_loss"],
            "wall_ratio_auto": auto["wall_s"] / auto["ideal_wall_s"]}


def targets_line(f: dict[str, Any]) -> str:
    checks = [(f"util-min-auto {f['util_min_auto']:.3f} (target >= {UTIL_MIN})", f["util_min_auto"] >= UTIL_MIN),
              (f"loss-ratio-auto {f['loss_ratio_auto']:.4f} (target <= {LOSS_RATIO_MAX})",
               f["loss_ratio_auto"] <= LOSS_RATIO_MAX)]
    return ("targets: " + "; ".join(f"{what} {met(ok)}" for what, ok in checks)
            + f"; util-min-steps {f['util_min_steps']:.3f} (reported)")


def final_line(f: dict[str, Any]) -> str:
    return (f"hetero: util-min-steps={f['util_min_steps']:.3f} util-min-auto={f['util_min_auto']:.3f} "
            f"loss-ratio-auto={f['loss_ratio_auto']:.4f} wall-ratio-auto={fmt_or_na(f['wall_ratio_auto'], '.3f')}")


def table(runs: dict[str, dict[str, Any]]) -> str:
    """The per-run table: wall time, ideal wall time, versions, eval loss, and per island utilization/tokens."""
    names = sorted({n for r in runs.values() for n in r["util"]})  # an island the driver stopped is absent
    head = f"{'run':<10} {'wall s':>7} {'ideal s':>7} {'vers':>4} {'eval loss':>9}  " + "  ".join(
        f"{n + ' util/Mtok':>20}" for n in names)
    rows = [head]
    for run, r in runs.items():
        cells = "  ".join(f"{r['util'][n]:>11.3f}/{r['tokens'][n] / 1e6:>8.3f}" if n in r["util"]
                          else f"{'(stopped)':>20}" for n in names)
        rows.append(f"{run:<10} {r['wall_s']:>7.1f} {r['ideal_wall_s']:>7.1f} {r['versions']:>4} "
                    f"{r['eval_loss']:>9.4f}  {cells}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    runs = plan(cfg, args)
    n = len(args.speeds)
    work = Path(tempfile.mkdtemp(prefix="dtrain-hetero-"))
    log(f"config {args.config}: {n} islands, speeds {args.speeds}, batches {args.batches}, devices {args.devices}, "
        f"H={args.inner_steps}, R={args.rounds}; runs under {work}")
    results = {}
    try:
        for name, (run_cfg, specs) in runs.items():
            results[name] = run_figures(_simulate(name, run_cfg, specs, n, args, work))
    except DtrainError as e:
        raise DtrainError(f"{e} (run folders kept under {work})") from None
    result = figures(results["identical"], results["steps"], results["auto"])
    print(table(results))
    out = {"figures": result, "targets": TARGETS, "runs": results,
           "islands": {"speeds": args.speeds, "batches": args.batches, "devices": args.devices}}
    finish(out, args.json, work, args.keep, targets_line(result), final_line(result))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/hetero.py", main))
