"""Adversary: hostile islands and hostile clients against the default config, each attack a real run.

Every run is a process-mode ``dtrain simulate`` (``dtrain_cli.simulate.run_simulation``: a coordinator and 4
worker processes on loopback, configs/tiny.toml by default, the default config otherwise but for
:data:`RUN_SETTINGS`: the islands wait for one another before round 1, and the run has 6 rounds). In order:

  fault-free      no attack (the reference for L), and the same run with the merge defaults of before the
                  robust merge (:data:`OLD_DEFAULTS`: the mean, no round screen, a 32-norm window, no quarantine
                  of islands, no throttle) for C
  minus1/3/20     island-1 pushes −1 x, −3 x, −20 x its honest delta, every push (``--fault
                  scale:island-1@v0,factor=F``, workers/push_faults.py)
  sybil-ramp      island-1..3 (3 of 4) grow their pushes 1.2 x a round (``ramp``), all under one credential:
                  island-1's. The run has an identity per island (``dtrain simulate --island-tokens``:
                  ``security.identity = "token"``, each island its own issued token) and island-2 and island-3
                  present island-1's
                  (``--island island-2:credential=island-1``): the coordinator must refuse them at Join (one
                  credential = one island). A run that lets more than one of them join, or refuses one without
                  a reason naming the credential, is not survived, whatever its loss. The islands that joined
                  wait up to :data:`SYBIL_START_WAIT_S` for the others (they never come)
  idle20/idle200  20 and 200 PushDelta streams opened with the run's token once the 4 islands joined, that never
                  send a byte (held until the run ends): the honest islands' heartbeats, pushes and pulls must go on
  join-flood      5,000 Join calls of new names (8 threads) with the run's token and fingerprint once the 4 islands
                  joined: each refused (every shard is held) while the run goes on, Status answered after; the
                  coordinator's RSS before and after is reported

A run survives when it ends by itself (within --timeout) with every honest island present at the end (none lost,
quarantined or unfinished) and, for sybil-ramp, at most one of the Byzantine islands joined. Figures:

  A   attacks run; S  of them survived
  L   worst final eval loss of an attacked run (survived or not; one that did not end: inf) over the fault-free
      run's
  H   honest islands declared lost or quarantined by the coordinator (``island_lost``, ``island_quarantined``),
      over every attacked run
  C   the fault-free run's final eval loss with the default config over its loss with OLD_DEFAULTS

Targets: S = A, L <= 1.05, H = 0, C <= 1.005. A missed target is reported (NOT met) but does not change the exit
status; a bad argument or a run that fails to start does (one line on stderr, exit 2 or 1). Last line:

  adversary: attacks=A survived=S worst-loss-ratio=L honest-lost=H clean-cost=C
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX (in this process and the workers it starts)

from _common import finish, fmt_or_na, log, met

from dtrain.config.derived import merge_rule
from dtrain.config.load import load_config, replace
from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain.runlog import read_events
from dtrain_cli.entry import Parser, run_main
from dtrain_cli.fault_spec import parse_fault
from dtrain_cli.island_spec import parse_islands
from dtrain_cli.simulate import run_simulation

ISLANDS = 4
BYZANTINE = "island-1"
SYBILS = ("island-1", "island-2", "island-3")
ATTACKS = ("minus1", "minus3", "minus20", "sybil-ramp", "idle20", "idle200", "join-flood")
QUICK_ATTACKS = ("minus3", "minus20")
FLOOD_JOINS = 5000
# The settings every run changes. The islands wait up to 600 s for one another before round 1 (default 60 s): on a
# loaded shared machine they start minutes apart, and a run whose first rounds have two islands is not the case
# measured (one Byzantine island of four). And 6 rounds rather than tiny's 3 (train.steps 120, H 20): an attacked
# run keeps every shard's data, so the 3 honest islands take one version more than the fault-free run, and in a
# run of 3 versions tiny's eval loss rises at its last one with the default outer step (fault-free: 3.1989 at v2,
# 3.5859 at v3; the momentum carries θ on along the first rounds' direction), so the extra version alone read as
# a 6.6% loss (L 1.0665) with no Byzantine push merged. With 6 rounds the loss still falls at the end.
RUN_SETTINGS = ("worker.start_wait_s=600", "train.steps=120")
SYBIL_START_WAIT_S = 120  # the Sybil run: the two islands that join do not wait 600 s for the two refused
# The merge defaults of before the robust merge: the C figure's reference.
OLD_DEFAULTS = ("coordinator.merge_rule=mean", "coordinator.round_norm_ratio=0", "coordinator.norm_window=32",
                "coordinator.max_rejections=0", "coordinator.reject_backoff_s=0")
TARGETS = {"survived": "= attacks", "worst_loss_ratio": "<= 1.05", "honest_lost": "= 0", "clean_cost": "<= 1.005"}
LOSS_RATIO_MAX, CLEAN_COST_MAX = 1.05, 1.005


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/adversary.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="config file or name (default: tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"comma-separated attacks to run (default: all: {','.join(ATTACKS)})")
    p.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK_ATTACKS)} (and the fault-free runs)")
    p.add_argument("--no-clean-cost", action="store_true", help="skip the OLD_DEFAULTS run (C is then n/a)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each worker to its share of the CPUs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take (default 900): a run "
                   "still going then has not ended by itself (not survived)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (events, logs, summaries)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    chosen = QUICK_ATTACKS if args.quick else tuple(a.strip() for a in args.attacks.split(",") if a.strip())
    unknown = [a for a in chosen if a not in ATTACKS]
    if unknown or not chosen:
        p.error(f"--attacks: unknown attack(s) {', '.join(unknown) or '(none given)'}; one of {', '.join(ATTACKS)}")
    args.chosen = list(dict.fromkeys(chosen))
    return args


@dataclass
class Attack:
    """One attacked run: its faults (``dtrain simulate --fault``), its Byzantine islands, and what it does from
    the side once its islands joined (``side``: given the coordinator's address, the run's config and a stop
    event; returns its own figures)."""

    name: str
    faults: list[str] = field(default_factory=list)
    byzantine: tuple[str, ...] = ()
    side: Callable[[str, Config, threading.Event], dict[str, Any]] | None = None
    settings: tuple[str, ...] = ()  # the run's own config settings (SECTION.FIELD=VALUE)
    islands: tuple[str, ...] = ()  # islands' own settings (``dtrain simulate --island``)
    own_tokens: bool = False  # an identity per island (``dtrain simulate --island-tokens``)


def attacks() -> dict[str, Attack]:
    return {
        "minus1": Attack("minus1", [f"scale:{BYZANTINE}@v0,factor=-1"], (BYZANTINE,)),
        "minus3": Attack("minus3", [f"scale:{BYZANTINE}@v0,factor=-3"], (BYZANTINE,)),
        "minus20": Attack("minus20", [f"scale:{BYZANTINE}@v0,factor=-20"], (BYZANTINE,)),
        "sybil-ramp": Attack("sybil-ramp", [f"ramp:{n}@v0,factor=1.2" for n in SYBILS], SYBILS,
                             settings=(f"worker.start_wait_s={SYBIL_START_WAIT_S}",), own_tokens=True,
                             islands=tuple(f"{n}:credential={SYBILS[0]}" for n in SYBILS[1:])),
        "idle20": Attack("idle20", side=lambda addr, cfg, stop: idle_streams(addr, cfg, 20, stop)),
        "idle200": Attack("idle200", side=lambda addr, cfg, stop: idle_streams(addr, cfg, 200, stop)),
        "join-flood": Attack("join-flood", side=lambda addr, cfg, stop: join_flood(addr, cfg, FLOOD_JOINS)),
    }


# -- the side attacks: real gRPC clients of the run's coordinator ---------------------------------------------


def _stub(address: str, cfg: Config) -> tuple[Any, Any, list[tuple[str, str]]]:
    """A channel and stub to the coordinator, and the metadata that carries the run's token (if any)."""
    import grpc

    from dtrain.net.proto import dtrain_pb2_grpc
    from dtrain.net.wire import AUTH_METADATA_KEY

    channel = grpc.insecure_channel(address)
    token = os.environ.get(cfg.security.token_env, "") if cfg.security.token_env else ""
    metadata = [(AUTH_METADATA_KEY, f"Bearer {token}")] if token else []
    return channel, dtrain_pb2_grpc.CoordinatorStub(channel), metadata


def idle_streams(address: str, cfg: Config, n: int, stop: threading.Event) -> dict[str, Any]:
    """Opens ``n`` PushDelta streams that send nothing until ``stop`` is set (the run's end), then cancels them;
    returns how many the coordinator had ended by then, and how."""
    channel, stub, metadata = _stub(address, cfg)

    def silent():  # a request stream that never yields: the call stays open, idle
        stop.wait()
        return
        yield  # noqa: B901 - makes this a generator

    calls = [stub.PushDelta.future(silent(), metadata=metadata) for _ in range(n)]
    stop.wait()
    ended = {}
    for c in calls:
        if c.done():
            code = c.code().name if c.exception() is not None else "OK"
            ended[code] = ended.get(code, 0) + 1
        c.cancel()
    channel.close()
    return {"streams": n, "ended_by_coordinator": ended}


def join_flood(address: str, cfg: Config, n: int, threads: int = 8) -> dict[str, Any]:
    """``n`` Join calls of new names, on ``threads`` threads, with the run's fingerprint; returns what they got
    and the Status afterwards (how many islands it lists, its size)."""
    import grpc

    from dtrain.net.proto import dtrain_pb2 as pb

    channel, stub, metadata = _stub(address, cfg)
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def joins(first: int) -> None:
        for i in range(first, n, threads):
            req = pb.JoinRequest(island=f"flood-{i}", hardware="cpu", devices=1, fingerprint=cfg.fingerprint(),
                                 fingerprint_fields=cfg.fingerprint_fields())
            try:
                stub.Join(req, timeout=30, metadata=metadata)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1

    t0 = time.perf_counter()
    workers = [threading.Thread(target=joins, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    flood_s = time.perf_counter() - t0
    out: dict[str, Any] = {"joins": n, "codes": codes, "flood_s": round(flood_s, 3), "joined": codes.get("OK", 0)}
    try:
        status = stub.Status(pb.StatusRequest(), timeout=30, metadata=metadata)
        out.update(status_islands=len(status.islands), status_bytes=status.ByteSize())
    except grpc.RpcError as e:
        out["error"] = f"Status after the flood: {e.code().name}"
    if codes.get("UNAVAILABLE"):  # the coordinator had stopped serving (the run ended) or could not answer
        out["error"] = (f"{codes['UNAVAILABLE']} of {n} Joins found no coordinator (UNAVAILABLE): the run ended "
                        f"or the coordinator stopped answering before the flood was over")
    channel.close()
    return out


def _coordinator_pid(run_dir: Path) -> int | None:
    """The pid of the coordinator process serving ``run_dir`` (from /proc), if found."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"coordinator" in argv and str(run_dir).encode() in argv:
            return int(proc.name)
    return None


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _side_runner(attack: Attack, run_dir: Path, cfg: Config, stop: threading.Event, out: dict[str, Any]
                 ) -> threading.Thread:
    """A thread that waits for the run's coordinator and its 4 islands to have joined, then runs ``attack.side``
    with the coordinator's RSS before and after; its figures land in ``out``."""

    def run() -> None:
        info, events = run_dir / "coordinator.json", run_dir / "events.jsonl"
        while not stop.is_set():
            if info.exists() and events.exists() and events.read_text().count('"island_joined"') >= ISLANDS:
                break
            time.sleep(0.2)
        if stop.is_set():
            out["error"] = "the run ended before its islands had joined"
            return
        address = f"127.0.0.1:{json.loads(info.read_text())['port']}"
        pid = _coordinator_pid(run_dir)
        before = _rss(pid)
        log(f"{attack.name}: attacking {address} (coordinator RSS {fmt_or_na(before and before / 1e6, '.0f', ' MB')})")
        assert attack.side is not None
        try:
            out.update(attack.side(address, cfg, stop))
        except Exception as e:  # noqa: BLE001 - a side attack that breaks is a figure, not a crash
            out["error"] = f"{type(e).__name__}: {e}"
        after = _rss(pid)
        out["rss_before"], out["rss_after"] = before, after
        log(f"{attack.name}: done {out} (coordinator RSS {fmt_or_na(after and after / 1e6, '.0f', ' MB')})")

    t = threading.Thread(target=run, name=f"side-{attack.name}", daemon=True)
    t.start()
    return t


# -- a run and its verdict --------------------------------------------------------------------------------------


def _of(island: str, names: tuple[str, ...] | list[str]) -> str | None:
    """The island an event names (its ``island`` field: the island's name), if it is one of ``names``."""
    return island if island in names else None


def verdict(name: str, summary: dict[str, Any] | None, coord_events: list[dict[str, Any]],
            byzantine: tuple[str, ...], side: dict[str, Any] | None, error: str = "") -> dict[str, Any]:
    """Whether an attacked run survived, and its figures, from its summary (None: it did not end by itself) and
    the coordinator's events."""
    names = [f"island-{i}" for i in range(ISLANDS)]
    honest = [n for n in names if n not in byzantine]
    lost = sorted({n for e in coord_events if e.get("event") in ("island_lost", "island_quarantined")
                   for n in [_of(str(e.get("island", "")), honest)] if n})
    joined_byz = sorted({e.get("name") for e in coord_events
                         if e.get("event") == "island_joined" and e.get("name") in byzantine})
    quarantined = sorted({n for e in coord_events if e.get("event") == "island_quarantined"
                          for n in [_of(str(e.get("island", "")), names)] if n})
    why: list[str] = [error] if error else []
    if summary is not None:
        absent = [n for n in honest if n in summary.get("unfinished_islands", [])
                  or n in summary.get("quarantined_islands", [])]
        if absent:
            why.append(f"honest islands not present at the end: {', '.join(absent)}")
    if lost:
        why.append(f"honest islands lost or quarantined: {', '.join(lost)}")
    if len(byzantine) > 1 and len(joined_byz) > 1:
        why.append(f"{len(joined_byz)} islands joined under one credential ({', '.join(joined_byz)}): the Sybil "
                   f"was not refused at Join")
    refused = summary.get("refused_islands", {}) if summary is not None else {}
    unclear = [n for n, line in refused.items() if "PERMISSION_DENIED" not in line or "token" not in line]
    if unclear:
        why.append(f"refused without a clear reason (PERMISSION_DENIED naming the token): {', '.join(unclear)}")
    if side and side.get("error"):
        why.append(f"side attack: {side['error']}")
    if side and side.get("joined"):
        why.append(f"{side['joined']} flood Joins were accepted")
    loss = summary["final_eval_loss"] if summary is not None else math.inf
    return {"attack": name, "survived": summary is not None and not why, "why": why, "final_eval_loss": loss,
            "honest_lost": len(lost), "quarantined": quarantined, "byzantine_joined": joined_byz, "refused": refused,
            "rounds": summary["rounds"] if summary is not None else None, "side": side}


def _simulate(cfg: Config, name: str, faults: list[str], args: argparse.Namespace, work: Path,
              attack: Attack | None = None) -> tuple[dict[str, Any] | None, list[dict[str, Any]], dict[str, Any],
                                                     str]:
    """One run: (its summary or None if it did not end by itself, the coordinator's events, the side attack's
    figures, the error)."""
    run_cfg = replace(cfg, run={"name": name, "out_dir": str(work)})
    run_dir = work / name
    stop, side, thread = threading.Event(), {}, None
    if attack is not None and attack.side is not None:
        thread = _side_runner(attack, run_dir, run_cfg, stop, side)
    t0 = time.perf_counter()
    summary, error = None, ""
    specs = parse_islands(attack.islands, ISLANDS, run_cfg) if attack is not None else {}
    try:
        summary = run_simulation(run_cfg, ISLANDS, quiet=True, pin=not args.no_pin, timeout_s=args.timeout,
                                 faults=[parse_fault(f, ISLANDS) for f in faults], island_specs=specs,
                                 own_tokens=attack is not None and attack.own_tokens)
    except DtrainError as e:
        error = str(e)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=120)
    loss = fmt_or_na(summary and summary["final_eval_loss"], ".4f")
    log(f"{name}: {'ended' if summary else 'did not end: ' + error}; eval loss {loss}, "
        f"{time.perf_counter() - t0:.0f}s -> {run_dir}")
    return summary, read_events(run_dir, skip_torn=True, missing_ok=True), side, error


def figures(clean: dict[str, Any], old: dict[str, Any] | None, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's figures from the fault-free summaries (``old``: with OLD_DEFAULTS, None if not run) and the
    attacked runs' verdicts."""
    ratios = [r["final_eval_loss"] / clean["final_eval_loss"] for r in results]
    return {"attacks": len(results), "survived": sum(r["survived"] for r in results),
            "worst_loss_ratio": max(ratios) if ratios else None,
            "honest_lost": sum(r["honest_lost"] for r in results),
            "clean_cost": None if old is None else clean["final_eval_loss"] / old["final_eval_loss"]}


def targets_line(f: dict[str, Any]) -> str:
    worst, cost = f["worst_loss_ratio"], f["clean_cost"]
    checks = [
        (f"survived {f['survived']}/{f['attacks']} (target S = A)", f["survived"] == f["attacks"]),
        (f"worst-loss-ratio {fmt_or_na(worst, '.4f')} (target <= {LOSS_RATIO_MAX})",
         None if worst is None else worst <= LOSS_RATIO_MAX),
        (f"honest-lost {f['honest_lost']} (target 0)", f["honest_lost"] == 0),
        (f"clean-cost {fmt_or_na(cost, '.4f')} (target <= {CLEAN_COST_MAX})",
         None if cost is None else cost <= CLEAN_COST_MAX),
    ]
    return "targets: " + "; ".join(f"{what} {met(ok)}" for what, ok in checks)


def final_line(f: dict[str, Any]) -> str:
    return (f"adversary: attacks={f['attacks']} survived={f['survived']} "
            f"worst-loss-ratio={fmt_or_na(f['worst_loss_ratio'], '.4f')} honest-lost={f['honest_lost']} "
            f"clean-cost={fmt_or_na(f['clean_cost'], '.4f')}")


def _print_results(clean: dict[str, Any], results: list[dict[str, Any]]) -> None:
    print(f"\n{'attack':<12} {'survived':>8} {'eval loss':>10} {'ratio':>7} {'versions':>8}  quarantined; why not")
    for r in results:
        ratio = r["final_eval_loss"] / clean["final_eval_loss"]
        print(f"{r['attack']:<12} {'yes' if r['survived'] else 'NO':>8} {r['final_eval_loss']:>10.4f} "
              f"{ratio:>7.3f} {fmt_or_na(r['rounds'], 'd'):>8}  {', '.join(r['quarantined']) or '-'}"
              + (f"; {'; '.join(r['why'])}" if r["why"] else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = load_config(args.config, [*RUN_SETTINGS, *args.overrides])
    old_cfg = load_config(args.config, [*RUN_SETTINGS, *args.overrides, *OLD_DEFAULTS])
    work = Path(tempfile.mkdtemp(prefix="dtrain-adversary-"))
    co = cfg.coordinator
    log(f"config {args.config}: {ISLANDS} islands, {cfg.train.steps} steps, H={cfg.outer.inner_steps}; merge_rule "
        f"{merge_rule(cfg)}, round_norm_ratio {co.round_norm_ratio:g}, max_rejections {co.max_rejections}; attacks "
        f"{', '.join(args.chosen)}; runs under {work}")
    clean, _, _, error = _simulate(cfg, "fault-free", [], args, work)
    if clean is None:
        raise DtrainError(f"the fault-free run failed: {error} (run folders kept under {work})")
    old = None
    if not args.no_clean_cost:
        old, _, _, error = _simulate(old_cfg, "fault-free-old-defaults", [], args, work)
        if old is None:
            raise DtrainError(f"the fault-free run with the old defaults failed: {error} (kept under {work})")
    table = attacks()
    results = []
    for name in args.chosen:
        attack = table[name]
        acfg = load_config(args.config, [*RUN_SETTINGS, *args.overrides, *attack.settings]) if attack.settings else cfg
        summary, events, side, error = _simulate(acfg, name, attack.faults, args, work, attack)
        results.append(verdict(name, summary, events, attack.byzantine, side or None, error))
    f = figures(clean, old, results)
    _print_results(clean, results)
    print(f"\nfault-free: eval loss {clean['final_eval_loss']:.4f} ({merge_rule(cfg)})"
          + (f", with the old defaults {old['final_eval_loss']:.4f} (mean)" if old else ""))
    out = {"figures": f, "targets": TARGETS, "attacks": results, "fault_free": clean["final_eval_loss"],
           "fault_free_old_defaults": old["final_eval_loss"] if old else None}
    finish(out, args.json, work, args.keep, targets_line(f), final_line(f))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/adversary.py", main))
