"""A measured WAN: islands behind emulated wide-area links, for each codec, side by side in one run.

Real process-mode simulations (``dtrain_cli.simulate.run_simulation``: a coordinator and 4 worker processes on
loopback, configs/small.toml by default), each island behind its own emulated link (``dtrain simulate --link``,
dtrain_cli/link_proxy.py: each direction a pipe of the link's bandwidth and half its round trip, shared by the
island's connections). For every link of ``--links`` (default 100mbit/100ms and 20mbit/200ms) and every codec of
``--codecs`` (default int8, int4 and sparse: ``codec.up`` and ``codec.down`` both set to it), one run of the same
config; with ``--fragments F`` (default: 2 with the default codecs where 2 divides H), also sparse with
``outer.fragments = F`` (Streaming DiLoCo; named ``sparse-fF``, its rounds are fragment exchanges, one every H/F
steps, so its bytes per round are per fragment). Per run: the training wall time (the longest island's time in its
training loop), each island's utilization (time in inner steps / training wall time), bytes per round each way (per
island, the mean over its rounds: pushes up, pulled updates down; the full θ pulled at join is left out, as in
benchmarks/convergence.py) and the peak bytes in flight per island (its largest push frame plus its pulls' bytes per
round: what one exchange puts on its link), and the final eval loss.

Figures (the first link is L1, the second L2):

  A, B   util-int8 and util-sparse on L1: the lowest island utilization of the int8 and sparse runs
  C      bytes-ratio on L1: sparse / int8 bytes per round, both directions
  D, E   util-int8 and util-sparse on L2

Target: sparse keeps utilization >= 0.95 on both links. A missed target is reported (NOT met) but does not
change the exit status; a bad argument or a run that fails does (one line on stderr, exit 2 or 1). Last line:

  wan: link=L1 util-int8=A util-sparse=B bytes-ratio=C link=L2 util-int8=D util-sparse=E
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

from _common import codec_list, finish, fmt_or_na, log, met

from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config, ConfigError
from dtrain.errors import DtrainError
from dtrain.runlog import read_events
from dtrain_cli.entry import Parser, run_main
from dtrain_cli.island_spec import parse_islands
from dtrain_cli.link_proxy import LinkError, LinkShape, parse_link
from dtrain_cli.simulate import run_simulation

UTIL_MIN = 0.95
TARGETS = {"util_sparse": f">= {UTIL_MIN} on every link"}


DEFAULT_FRAGMENTS = 2  # the sparse-with-fragments run of the default invocation: sparse-f2


def _links(text: str) -> list[LinkShape]:
    try:
        return [parse_link(x) for x in text.split(",")]
    except LinkError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/wan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="config file or name (default: small)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--islands", type=int, default=4, help="islands per run (default 4)")
    p.add_argument("--links", type=_links, default=_links("100mbit/100ms,20mbit/200ms"),
                   help="links, RATE/RTT separated by commas (default 100mbit/100ms,20mbit/200ms)")
    p.add_argument("--codecs", type=codec_list, default=None,
                   help="codecs, separated by commas (default int8,int4,sparse)")
    p.add_argument("--fragments", type=int, default=None, metavar="F",
                   help="also run sparse with outer.fragments = F (Streaming DiLoCo) on every link, as codec "
                   "'sparse-fF'; F must divide outer.inner_steps (small's 50: 2 or 5); 0: no such run; default 2 "
                   "when outer.inner_steps is even and --codecs is not given, else 0")
    p.add_argument("--loopback", action="store_true",
                   help="also run every codec with no link (loopback, shown as link 'loopback'): the utilization the "
                   "CPU alone allows, to tell a link's cost from a loaded machine's")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each simulation may take (default 3600)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each worker to its share of the CPUs")
    p.add_argument("--keep", action="store_true", help="keep the run folders (events, logs, summaries)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.islands < 1:
        p.error("--islands must be >= 1")
    if args.fragments is not None and (args.fragments < 0 or args.fragments == 1):
        p.error("--fragments must be 0 (no fragments run) or >= 2")
    args.default_codecs = args.codecs is None  # with --fragments unset: a sparse-f2 run too (main, against H)
    if args.codecs is None:
        args.codecs = ["int8", "int4", "sparse"]
    return args


def run_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its summary and its islands' events (the ``push_sent`` frames' bytes)."""
    islands = sorted(summary["islands"], key=lambda s: s["island"])
    run_dir = Path(summary["run_dir"])
    per: dict[str, dict[str, Any]] = {}
    for s in islands:
        events = read_events(run_dir / "islands" / s["island"], skip_torn=True, missing_ok=True)
        pushes = [e["bytes"] for e in events if e.get("event") == "push_sent" and "bytes" in e]
        rounds = max(len(pushes), 1)
        down = (s["bytes_down"] - s.get("bytes_down_full", 0)) / rounds  # the updates, not the full θ at join
        per[s["island"]] = {"util": s["utilization"], "up_per_round": s["bytes_up"] / rounds,
                            "down_per_round": down, "peak_in_flight": int(max(pushes, default=0) + down)}
    return {"wall_s": max(s["active_s"] for s in islands), "util_min": min(p["util"] for p in per.values()),
            "up_per_round": sum(p["up_per_round"] for p in per.values()) / len(per),
            "down_per_round": sum(p["down_per_round"] for p in per.values()) / len(per),
            "peak_in_flight": max(p["peak_in_flight"] for p in per.values()), "islands": per,
            "eval_loss": summary["final_eval_loss"], "versions": summary["rounds"],
            "audit": {k: summary["audit"][k] for k in ("lost_tokens", "doubled_tokens")}}


def figures(runs: dict[str, dict[str, dict[str, Any]]], links: list[str]) -> dict[str, Any]:
    """The last line's figures from ``runs[link][codec]`` (:func:`run_figures`); None where a run is absent."""
    def util(link: str, codec: str) -> float | None:
        r = runs.get(link, {}).get(codec)
        return None if r is None else r["util_min"]

    first = runs.get(links[0], {})
    ratio = None
    if "int8" in first and "sparse" in first:
        both = {c: first[c]["up_per_round"] + first[c]["down_per_round"] for c in ("int8", "sparse")}
        ratio = both["sparse"] / both["int8"] if both["int8"] else None
    return {"links": {link: {"util_int8": util(link, "int8"), "util_sparse": util(link, "sparse")}
                      for link in links}, "bytes_ratio": ratio}


def targets_line(f: dict[str, Any]) -> str:
    checks = []
    for link, u in f["links"].items():
        x = u["util_sparse"]
        checks.append(f"util-sparse {fmt_or_na(x, '.3f')} on {link} (target >= {UTIL_MIN}) "
                      f"{met(None if x is None else x >= UTIL_MIN)}")
    return "targets: " + "; ".join(checks)


def final_line(f: dict[str, Any]) -> str:
    parts = ["wan:"]
    for i, (link, u) in enumerate(f["links"].items()):
        parts.append(f"link={link} util-int8={fmt_or_na(u['util_int8'], '.3f')} "
                     f"util-sparse={fmt_or_na(u['util_sparse'], '.3f')}")
        if i == 0:
            parts.append(f"bytes-ratio={fmt_or_na(f['bytes_ratio'], '.4f')}")
    return " ".join(parts)


def table(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    rows = [f"{'link':<14} {'codec':<9} {'wall s':>7} {'util min':>8} {'up B/round':>11} {'down B/round':>12} "
            f"{'peak B':>10} {'vers':>4} {'eval loss':>9}"]
    for link, by_codec in runs.items():
        for codec, r in by_codec.items():
            rows.append(f"{link:<14} {codec:<9} {r['wall_s']:>7.1f} {r['util_min']:>8.3f} {r['up_per_round']:>11,.0f} "
                        f"{r['down_per_round']:>12,.0f} {r['peak_in_flight']:>10,} {r['versions']:>4} "
                        f"{r['eval_loss']:>9.4f}")
    return "\n".join(rows)


def _simulate(cfg: Config, link: LinkShape | None, codec: str, args: argparse.Namespace, work: Path
              ) -> dict[str, Any]:
    """One run; ``codec`` is a codec name, or ``sparse-fF`` for sparse with outer.fragments = F; ``link`` None:
    loopback, no link."""
    name = f"{codec}-{str(link or 'loopback').replace('/', '-')}"
    fragments = int(codec.removeprefix("sparse-f")) if codec.startswith("sparse-f") else 1
    base = "sparse" if fragments > 1 else codec
    run_cfg = replace(cfg, run={"name": name, "out_dir": str(work)}, codec={"up": base, "down": base},
                      outer={"fragments": fragments})
    specs = parse_islands([f"island-{i}:link={link}" for i in range(args.islands)], args.islands, run_cfg) \
        if link else None
    t0 = time.perf_counter()
    summary = run_simulation(run_cfg, args.islands, quiet=True, pin=not args.no_pin, timeout_s=args.timeout,
                             island_specs=specs)
    r = run_figures(summary)
    log(f"{name}: {r['versions']} versions, eval loss {r['eval_loss']:.4f}, utilization min {r['util_min']:.3f}, "
        f"{r['up_per_round']:,.0f} B up / {r['down_per_round']:,.0f} B down per round per island, "
        f"{time.perf_counter() - t0:.0f}s -> {summary['run_dir']}")
    return r


def run_codecs(args: argparse.Namespace, cfg: Config) -> list[str]:
    """The runs' codecs per link: ``--codecs``, then ``sparse-fF`` for ``--fragments F`` (unset: F = 2 with the default
    codecs where 2 divides H, else none). ConfigError if F does not divide ``outer.inner_steps``."""
    codecs = list(args.codecs)
    if args.fragments is None:  # the default: 2 fragments with the default codecs, where they divide H
        args.fragments = DEFAULT_FRAGMENTS if args.default_codecs and cfg.outer.inner_steps % DEFAULT_FRAGMENTS == 0 \
            else 0
    if args.fragments:
        if cfg.outer.inner_steps % args.fragments:
            raise ConfigError(f"--fragments {args.fragments} must divide outer.inner_steps = "
                              f"{cfg.outer.inner_steps} (pick a divisor, or --set outer.inner_steps=...)")
        codecs.append(f"sparse-f{args.fragments}")
    return codecs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    codecs = run_codecs(args, cfg)
    links = [str(x) for x in args.links]
    work = Path(tempfile.mkdtemp(prefix="dtrain-wan-"))
    log(f"config {args.config}: {args.islands} islands, links {', '.join(links)}, codecs {', '.join(codecs)}; "
        f"runs under {work}")
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for link in [*args.links, *([None] if args.loopback else [])]:
            for codec in codecs:
                runs.setdefault(str(link or "loopback"), {})[codec] = _simulate(cfg, link, codec, args, work)
    except DtrainError as e:
        raise DtrainError(f"{e} (run folders kept under {work})") from None
    f = figures(runs, links)
    print(table(runs))
    out = {"figures": f, "targets": TARGETS, "runs": runs}
    finish(out, args.json, work, args.keep, targets_line(f), final_line(f))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/wan.py", main))
