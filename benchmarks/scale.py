"""Scale of one coordinator: 8, 16, 32 and 64 simulated islands pushing and pulling real frames, no training.

Per island count N (``--sizes``), one ``dtrain coordinator`` child process (``python -m dtrain_cli coordinator``
on 127.0.0.1:0, benchmarks/_common.py's CoordinatorProcess) in sync mode with ``coordinator.min_quorum = N``
(a round closes when every island has pushed), ``coordinator.checkpoint = false``, and N islands as threads of
this process. Each island is what a real island does at the wire, without the training:

  - it joins through the real client (workers/client.py ``CoordinatorClient``, one channel per island) and
    heartbeats every ``worker.heartbeat_s`` (1 s) from a thread of its own, reporting the version it holds;
  - each round it pushes one real compressed frame (``dtrain.codec``: a random normal x 1e-3 delta of the
    model's parameter count, quantized with ``codec.up`` = int8 and framed at the islands' push level, stored
    without zstd by default, ``codec.push_level``; a pool of ``FRAME_POOL`` distinct frames encoded before
    anything is timed, island i pushing frame (i + round) mod pool), then pulls
    with the worker's long poll (``workers.exchange.PULL_WAIT_S``) until it holds the new version's update frame.

The model: configs/small.toml's GPT with d_model=512, n_layers=8 (25,478,144 parameters, 101.9 MB fp32; int8
frames of 25.5 MB), the exchange benchmark's default; ``--params P`` picks another size. At 64 islands the
coordinator spools 64 frame bodies (1.6 GB) to disk per round; this process holds the frame pool (0.2 GB).

Figures, per N:

  round s      median over ``--rounds`` timed rounds (after ``--warmup`` untimed ones) of: the first island's
               push starts -> every island holds the new version (its pull returned the update frame)
  peak RSS     the coordinator's VmHWM over the rounds, warm-up included (reset through /proc/PID/clear_refs
               after the joins, so the start-up does not count; where the kernel refuses, from the start)
  RSS/model    peak RSS / (4 x params); net/model: (peak RSS - a no-model coordinator's VmHWM, the Python +
               gRPC + numpy runtime) / (4 x params). Both are printed; the target is on the raw figure
  in / out     frame bytes the coordinator received / sent per round (its Status counters), median
  cpu s        the coordinator's CPU seconds per round (/proc), median; this process's (all island threads)
  params/core-s  N x params / the coordinator's CPU seconds per round: parameters merged per core-second, counting
               everything the coordinator does in a round (gRPC in and out, decode and spool, the outer step and
               its update frame, the pulls, heartbeats)
  heartbeat    heartbeat round trips during the rounds: median and largest, and the ones that failed

Then the slope of round s over N (least squares over the sizes) and the targets:

  linear:  round_s(N_max) / round_s(N_min) <= LINEAR_TOLERANCE x N_max / N_min (round time grows no faster than
           the island count, with 25% of slack for noise on this shared machine)
  memory:  peak RSS / model <= 3 at N_max
  speed:   params/core-s >= PARAMS_PER_CORE_S_TARGET (3e8, int8: issue 36, item 8) at N_max, printed beside the
           floor below; the earlier target, PARAMS_PER_CORE_S_MIN (5e8, set with c4a8f2c), is printed beside it,
           met or not
  heartbeats: the largest heartbeat round trip at N_max <= HEARTBEAT_MAX_OF_LEASE (half) of the default
           coordinator.lease_s (4 s), and none failed (the benchmark itself runs with a LEASE_S lease)

The floor (``--no-floor`` skips it): after the rows, at N_max, the same island threads push the same frames in
the same chunks to a bare Python gRPC server in its own process (``_common.RawServer``, the coordinator's channel
options) and pull the same update bytes in the coordinator's pull pieces; the server's CPU per round gives the
params/core-s of the transport alone, zstd decoding a frame as the coordinator does (chunks in, 256 KiB pieces
out) that of the codec's entropy stage (none for stored frames: the ceiling is then the wire's), and the two in
series the ceiling a coordinator doing nothing else would reach on this machine. The targets line says how much
of it the coordinator reached.

A missed target is reported (NOT met) but does not change the exit status; a bad argument or a run that fails
does (one line on stderr, through ``dtrain_cli.entry.run_main``). Last line:

  scale: islands=N_max round-s=R rss/model=M params/core-s=P round-s-per-island-slope=S

P at N_max. ``--model-params 200M`` makes the merge's cost the largest part of a round (at 64 islands 12.8 GB of
int8 frames a round, spooled to disk: the coordinator's memory stays flat); ``--set coordinator.merge_threads=K``
sets the outer step's threads.

``--shards 1,2``: every island count again with a sharded coordinator of S processes (``coordinator.shards``;
docs/architecture.md#shards): range shards 1..S-1 (``dtrain coordinator --shard I``) and the lead, each a child
process; each island pushes one frame per range (the same fabricated delta cut by the plan) to its shard on
parallel streams (``workers.shard_links.ShardedPush``) and, once the lead serves the new version, pulls each range
shard's update too. ``cpu s`` is then every shard process's together (``coord cpu s`` in the table; the per-shard
split in the JSON), RSS the lead's, in/out the lead's counters. The last line gains ``shard-speedup=Q``: round s
with S = 1 over round s with the largest S, at the largest island count (target >= SHARD_SPEEDUP_MIN, meant for
shards on hosts of their own: on one host the shards share its cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX: this benchmark is about the host side

from _common import (
    FP32,
    MB,
    CoordinatorProcess,
    choose_model,
    cpu_seconds,
    fmt_or_na,
    int_list,
    log,
    make_config,
    make_frames,
    met,
    param_count,
    proc_mem,
    reset_peak_rss,
    run_concurrently,
    runtime_baseline,
)
from _scale_fleet import Heartbeats, RangeShards, pulls_at_once
from _scale_floor import transport_floor

from dtrain.config.sections import Config
from dtrain.errors import DtrainError
from dtrain_cli.entry import Parser, run_main

CODEC = "int8"
FRAME_POOL = 8  # distinct encoded frames; island i pushes frame (i + round) % FRAME_POOL
LINEAR_TOLERANCE = 1.25
RSS_OVER_MODEL_MAX = 3.0
LEASE_S = 30.0  # heartbeats stay at 1 s; a 30 s lease keeps an island whose heartbeat thread waits for a busy core
QUICK = {"sizes": [2, 4], "params": 100_000, "rounds": 2, "warmup": 0}
SHARD_SPEEDUP_MIN = 1.6
PARAMS_PER_CORE_S_TARGET = 3e8  # int8, end to end: issue 36, item 8
PARAMS_PER_CORE_S_MIN = 5e8  # int8, end to end: the earlier target (c4a8f2c), still printed, met or not
HEARTBEAT_MAX_OF_LEASE = 0.5  # the largest heartbeat round trip, at most this share of the default lease


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/scale.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int_list, default=None, help="island counts (default 8,16,32,64; --quick: 2,4)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per island count (default 3; --quick: 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds first, per island count (default 1; --quick: 0)")
    p.add_argument("--model-params", "--params", dest="params", type=param_count, default=None, metavar="P",
                   help="a model of about P parameters, e.g. 200M (default: d_model=512, n_layers=8, 25.5M; "
                        "--quick: 100k)")
    p.add_argument("--quick", action="store_true", help="a smoke test: sizes 2,4, 100k parameters, 2 rounds, "
                                                        "no warm-up, no runtime baseline")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the no-model coordinator whose VmHWM is the runtime baseline (net/model: n/a)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field of the coordinator's config (repeatable; after the benchmark's own)")
    p.add_argument("--shards", type=int_list, default=[1], metavar="S,...",
                   help="coordinator shard counts to measure each island count with (default 1; e.g. 1,2)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the transport floor (a bare gRPC server moving the same bytes, and zstd decoding)")
    p.add_argument("--keep", action="store_true", help="keep the temporary run folders (logs, events)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    for name, default in (("sizes", [8, 16, 32, 64]), ("rounds", 3), ("warmup", 1), ("params", None)):
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    if args.quick:
        args.no_baseline = True
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    args.sizes = sorted(set(args.sizes))
    args.shards = sorted(set(args.shards))
    if args.shards[0] < 1:
        p.error(f"--shards must be >= 1, got {args.shards[0]}")
    return args


# ---------------------------------------------------------------------------------------------- figures (pure)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ys over xs (nan with fewer than two distinct xs)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs, {len(ys)} ys")
    if len(set(xs)) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def growth(sizes: Sequence[int], round_s: Sequence[float]) -> dict[str, float]:
    """How round time grows from the smallest island count to the largest: ``ratio`` = round_s(max) /
    round_s(min), ``islands_ratio`` = max / min, ``limit`` = LINEAR_TOLERANCE x islands_ratio, and the
    ``per_island`` round seconds at each end."""
    lo, hi = min(range(len(sizes)), key=lambda i: sizes[i]), max(range(len(sizes)), key=lambda i: sizes[i])
    ratio = round_s[hi] / round_s[lo] if round_s[lo] > 0 else math.inf
    islands_ratio = sizes[hi] / sizes[lo]
    return {"ratio": ratio, "islands_ratio": islands_ratio, "limit": LINEAR_TOLERANCE * islands_ratio,
            "per_island_min": round_s[lo] / sizes[lo], "per_island_max": round_s[hi] / sizes[hi]}


def params_per_core_s(row: dict[str, Any], model_bytes: int) -> float | None:
    """Parameters merged per coordinator core-second in a row: islands x params / its coordinator CPU s per round
    (None: not measured)."""
    cpu = row.get("coordinator_cpu_s")
    return row["islands"] * (model_bytes // FP32) / cpu if cpu else None


def figures(rows: Sequence[dict[str, Any]], model_bytes: int, baseline: int | None) -> dict[str, Any]:
    """The summary from one row per island count (``islands``, ``round_s``, ``peak_rss``; ``coordinator_cpu_s``
    for params/core-s)."""
    rows = sorted(rows, key=lambda r: r["islands"])
    sizes = [r["islands"] for r in rows]
    times = [r["round_s"] for r in rows]
    top = rows[-1]
    g = growth(sizes, times) if len(rows) > 1 else None
    return {
        "islands": top["islands"], "round_s": top["round_s"],
        "rss_over_model": top["peak_rss"] / model_bytes,
        "net_rss_over_model": (top["peak_rss"] - baseline) / model_bytes if baseline is not None else None,
        "slope": slope(sizes, times), "growth": g, "params_per_core_s": params_per_core_s(top, model_bytes),
        "linear_ok": None if g is None else g["ratio"] <= g["limit"],
        "memory_ok": top["peak_rss"] / model_bytes <= RSS_OVER_MODEL_MAX,
        "heartbeat_max_s": top.get("heartbeat_max_s"), "heartbeat_failed": top.get("heartbeat_failed"),
    }


def default_lease_s() -> float:
    """The default ``coordinator.lease_s`` (the config's, not this benchmark's LEASE_S)."""
    from dtrain.config.sections import CoordinatorConfig

    return CoordinatorConfig().lease_s


def floor_figures(floor: dict[str, Any], params: int) -> dict[str, float | None]:
    """Parameters per core-second that the transport and the codec's entropy stage alone allow, from
    :func:`transport_floor`'s CPU seconds: ``wire`` (a bare gRPC server taking every island's push and serving
    every pull), ``decode`` (zstd-decompressing one pushed frame) and ``ceiling``, both in series (1 / (1/wire +
    1/decode)): what a coordinator doing nothing else would reach on this machine. Stored frames (``stored``:
    int8's default, no zstd) have no decode: the ceiling is the wire. None where a CPU time rounded to 0 (a tiny
    model: /proc counts in clock ticks)."""
    wire = params_per_core_s({"islands": floor["islands"], "coordinator_cpu_s": floor["server_cpu_s"]},
                             FP32 * params)  # the coordinator's own rule, on the bare server's CPU
    if floor.get("stored"):  # stored frames (int8's default): no entropy stage, the wire is the ceiling
        return {"wire": wire, "decode": None, "ceiling": wire}
    decode = params / floor["decode_cpu_s"] if floor["decode_cpu_s"] else None
    return {"wire": wire, "decode": decode, "ceiling": 1 / (1 / wire + 1 / decode) if wire and decode else None}


def targets_line(f: dict[str, Any]) -> str:
    g = f["growth"]
    linear = ("round time: one island count only" if g is None else
              f"round time x{g['ratio']:.2f} for x{g['islands_ratio']:g} islands (target <= {LINEAR_TOLERANCE:g} x "
              f"{g['islands_ratio']:g} = {g['limit']:g})")
    memory = f"peak RSS / model {f['rss_over_model']:.2f} at {f['islands']} islands (target <= {RSS_OVER_MODEL_MAX:g})"
    p = f.get("params_per_core_s")
    ceiling = f.get("floor", {}).get("ceiling")
    speed = (f"params/core-s {fmt_or_na(p, '.3g')} at {f['islands']} islands (target >= "
             f"{PARAMS_PER_CORE_S_TARGET:.0e}, issue 36"
             + (f"; gRPC (+ zstd) alone here: {ceiling:.3g}, {p / ceiling:.0%} of it reached" if p and ceiling
                else "") + f") {met(None if p is None else p >= PARAMS_PER_CORE_S_TARGET)}; the earlier target >= "
             f"{PARAMS_PER_CORE_S_MIN:.0e} (c4a8f2c) {met(None if p is None else p >= PARAMS_PER_CORE_S_MIN)}")
    hb, failed = f.get("heartbeat_max_s"), f.get("heartbeat_failed")
    hb_limit = HEARTBEAT_MAX_OF_LEASE * default_lease_s()
    hb_ok = None if hb is None or math.isnan(hb) else hb <= hb_limit and not failed
    beats = (f"largest heartbeat round trip {fmt_or_na(None if hb_ok is None else hb, '.2f')} s at {f['islands']} "
             f"islands, {failed or 0} failed (target <= {hb_limit:g} s, half the default lease, and none failed)")
    return (f"targets: {linear} {met(f['linear_ok'])}; {memory} {met(f['memory_ok'])}; {speed}; {beats} "
            f"{met(hb_ok)}")


def final_line(f: dict[str, Any]) -> str:
    return (f"scale: islands={f['islands']} round-s={f['round_s']:.3f} rss/model={f['rss_over_model']:.2f} "
            f"params/core-s={fmt_or_na(f['params_per_core_s'], '.3g')} round-s-per-island-slope={f['slope']:.4f}"
            + (f" shard-speedup={f['shard_speedup']:.2f}" if "shard_speedup" in f else ""))


def shard_plan(cfg: Config, work: Path, shards: int) -> Sequence[Any]:
    """The ranges of a coordinator of ``shards`` shards, from the model's tree (its spec, computed in a child
    process as the coordinator computes it)."""
    from coordinator.lifecycle import initial_parameters_file
    from dtrain.train.fragments import leaf_sizes, plan

    _, spec = initial_parameters_file(cfg, work / f"plan-{shards}", spec_only=True)
    return plan(leaf_sizes(spec), shards)


def table(rows: Sequence[dict[str, Any]], model_bytes: int, baseline: int | None) -> list[str]:
    head = (f"{'islands':>7} {'round s':>8} {'rounds s':<24} {'peak RSS':>9} {'RSS/model':>9} {'net/model':>9} "
            f"{'in MB/round':>11} {'out MB/round':>12} {'coord cpu s':>11} {'isl cpu s':>9} {'hb p50 ms':>9} "
            f"{'hb max ms':>9} {'hb fail':>7} {'params/core-s':>13}")
    out = [head]
    for r in sorted(rows, key=lambda r: r["islands"]):
        net = f"{(r['peak_rss'] - baseline) / model_bytes:.2f}" if baseline is not None else "n/a"
        walls = ",".join(f"{x:.2f}" for x in r["rounds_s"])
        out.append(f"{r['islands']:>7} {r['round_s']:>8.3f} {walls:<24} {r['peak_rss'] / (1 << 20):>5.0f} MiB "
                   f"{r['peak_rss'] / model_bytes:>9.2f} {net:>9} {r['bytes_in'] / MB:>11.1f} "
                   f"{r['bytes_out'] / MB:>12.1f} {r['coordinator_cpu_s']:>11.2f} {r['client_cpu_s']:>9.2f} "
                   f"{r['heartbeat_p50_s'] * 1e3:>9.1f} {r['heartbeat_max_s'] * 1e3:>9.1f} "
                   f"{r['heartbeat_failed']:>7} {fmt_or_na(params_per_core_s(r, model_bytes), '.3g'):>13}")
    return out


# ---------------------------------------------------------------------------------------------- one island count


def scale_config(model_fields: dict[str, int], work: Path, islands: int, rounds: int,
                 overrides: Sequence[str] = ()) -> Config:
    """The coordinator's config for ``islands`` islands: the shared benchmark config (benchmarks/_common.py
    make_config: no checkpoint, no retries) in sync mode, every island needed to close a round, a real heartbeat
    period, a lease of LEASE_S, the coordinator's own thread count for that many islands
    (coordinator.handlers.server_threads); then ``overrides``."""
    return make_config(model_fields, work, CODEC, islands, checkpoint=False, repeats=rounds, extra=[
        "coordinator.mode=sync", f"coordinator.min_quorum={islands}", f"coordinator.lease_s={LEASE_S:g}",
        "worker.heartbeat_s=1", *overrides])


def range_frames(n_params: int, count: int, block: int, level: int, ranges: Sequence[Any]) -> list[bytes]:
    """:func:`_common.make_frames`'s deltas cut by the shards' ``ranges``: each a ShardFrames of one frame per
    range, as a sharded island's Uplink builds them."""
    import numpy as np

    from dtrain import codec
    from dtrain.config.sections import CodecConfig
    from workers.exchange import ShardFrames

    bits, blk = CodecConfig(block=block).scheme(CODEC)
    out: list[bytes] = []
    for i in range(count):
        delta = np.random.default_rng(1000 + i).standard_normal(n_params, dtype=np.float32)
        delta *= np.float32(1e-3)
        out.append(ShardFrames([codec.encode(codec.quantize(delta[r.start:r.end], bits, blk), level)
                                for r in ranges]))
    return out


def run_size(model_fields: dict[str, int], n_params: int, frames: list[bytes], islands: int, rounds: int,
             warmup: int, work: Path, overrides: Sequence[str] = (), shards: int = 1) -> dict[str, Any]:
    """One coordinator process (``shards`` > 1: a sharded coordinator of that many, whose ranges ``frames`` are
    cut by) and ``islands`` island threads, ``warmup`` + ``rounds`` rounds; the row."""
    from dtrain.net.proto import dtrain_pb2 as pb
    from workers.client import CoordinatorClient
    from workers.exchange import PULL_WAIT_S
    from workers.shard_links import ShardedPush, ShardLinks

    cfg = scale_config(model_fields, work, islands, warmup + rounds, overrides)
    pulling = threading.BoundedSemaphore(pulls_at_once(islands, statistics.fmean(len(f) for f in frames)))
    range_shards = RangeShards(cfg, shards, work / f"shards-{islands}-{shards}") if shards > 1 else None
    try:
        if range_shards is not None:
            cfg = range_shards.cfg
        coord = CoordinatorProcess(cfg, work / f"coord-{islands}-{shards}")
    except BaseException:
        if range_shards is not None:
            range_shards.stop()
        raise
    pid = coord.proc.pid
    pids = [pid] + (range_shards.pids if range_shards is not None else [])
    clients: list[CoordinatorClient] = []
    links: list[ShardLinks] = []
    beats: Heartbeats | None = None
    try:
        clients = [CoordinatorClient(coord.address, cfg) for _ in range(islands)]
        joins = run_concurrently(islands, lambda i: clients[i].join(f"island-{i}", "cpu", 1))
        joined = [res for _, _, res in joins]
        if joined[0].tree_size != n_params:
            raise DtrainError(f"the coordinator's tree has {joined[0].tree_size} values, expected {n_params}")
        ids = [j.island_id for j in joined]
        if range_shards is not None:
            from coordinator.lifecycle import initial_parameters_file
            from dtrain.train.fragments import leaf_sizes, plan

            _, spec = initial_parameters_file(cfg, work / f"spec-{islands}-{shards}", spec_only=True)
            ranges = plan(leaf_sizes(spec), shards)
            for i in range(islands):
                links.append(ShardLinks(cfg, clients[i], ranges))
                links[-1].connect(joined[i].shard_addresses)
        cursors = [j.cursor for j in joined]
        held = [j.version for j in joined]
        beats = Heartbeats(clients, ids, held, cfg.worker.heartbeat_s)
        beats.start()
        tokens = cfg.train.batch_size * cfg.model.seq_len * cfg.outer.inner_steps
        seqs = cfg.train.batch_size * cfg.outer.inner_steps
        idle = proc_mem(pid)["VmRSS"]
        reset = reset_peak_rss(pid)
        beats.recording = True
        records = []
        for r in range(warmup + rounds):
            version = held[0]

            def island(i: int, r: int = r, version: int = version) -> tuple[float, int]:
                h = pb.PushHeader(island_id=ids[i], base_version=version, push_id=f"{ids[i]}-r{r}", tokens=tokens,
                                  inner_steps=cfg.outer.inner_steps, cursor_start=cursors[i],
                                  cursor_end=cursors[i] + seqs, shard_index=joined[i].shard_index,
                                  tree_digest=joined[i].tree_digest)
                frame = frames[(i + r) % len(frames)]
                resp = (ShardedPush(links[i]) if links else clients[i]).push(h, frame)
                if resp.status not in (pb.PUSH_STATUS_PENDING, pb.PUSH_STATUS_MERGED):
                    raise DtrainError(f"round {r}: {ids[i]}'s push came back {pb.PushStatus.Name(resp.status)}: "
                                      f"{resp.reason}")
                cursors[i] = resp.cursor
                with pulling:
                    while held[i] <= version:  # the worker's long poll, until the round's version is here
                        for f in clients[i].pull(ids[i], held[i], wait_s=PULL_WAIT_S):
                            if f.frame:
                                held[i] = f.header.version
                    for other in links[i].others if links else ():  # each range shard's update of that version
                        have = version
                        while have < held[i]:
                            for f in other.pull(ids[i], have, wait_s=PULL_WAIT_S):
                                if f.frame:
                                    have = f.header.version
                return time.perf_counter(), held[i]

            before = clients[0].status()
            cpu0 = [cpu_seconds(p) for p in pids], sum(os.times()[:2])
            res = run_concurrently(islands, island)
            cpu1 = [cpu_seconds(p) for p in pids], sum(os.times()[:2])
            per_shard = [b - a for a, b in zip(cpu0[0], cpu1[0], strict=True)]
            after = clients[0].status()
            wall = max(t for _, _, (t, _) in res) - min(t0 for t0, _, _ in res)
            if {v for _, _, (_, v) in res} != {version + 1}:
                raise DtrainError(f"round {r}: islands hold versions {sorted({v for _, _, (_, v) in res})}, "
                                  f"expected {version + 1}")
            records.append({"wall_s": wall, "bytes_in": after.bytes_in - before.bytes_in,
                            "bytes_out": after.bytes_out - before.bytes_out,
                            "coordinator_cpu_s": sum(per_shard), "shard_cpu_s": per_shard,
                            "client_cpu_s": cpu1[1] - cpu0[1], "warmup": r < warmup})
            log(f"{islands} islands, {shards} shard(s), round {r}{' (warm-up)' if r < warmup else ''}: {wall:.2f}s, "
                f"coordinator {sum(per_shard):.2f} CPU s ({', '.join(f'{c:.2f}' for c in per_shard)}), islands "
                f"{cpu1[1] - cpu0[1]:.2f} CPU s, load average {os.getloadavg()[0]:.2f}, "
                f"RSS {proc_mem(pid)['VmRSS'] / (1 << 20):.0f} MiB")
        beats.recording = False
        mem = proc_mem(pid)
        retries = sum(c.retries for c in clients) + sum(c.retries for x in links for c in x.others)
        if retries:
            raise DtrainError(f"{retries} retried calls at {islands} islands: the timings are not clean")
    finally:
        if beats is not None:
            beats.close()
        for x in links:
            x.close()
        for c in clients:
            c.close()
        end_mem, _ = coord.stop()
        if range_shards is not None:
            range_shards.stop()
    timed = [x for x in records if not x["warmup"]]
    rtts = sorted(beats.rtts) if beats is not None else []
    return {
        "islands": islands, "shards": shards, "round_s": statistics.median(x["wall_s"] for x in timed),
        "shard_cpu_s": [statistics.median(x["shard_cpu_s"][k] for x in timed) for k in range(shards)],
        "load_average": os.getloadavg()[0],
        "rounds_s": [x["wall_s"] for x in timed], "warmup_s": [x["wall_s"] for x in records if x["warmup"]],
        "peak_rss": mem["VmHWM"], "peak_reset": reset, "idle_rss": idle, "start_vmhwm": coord.mem_at_start["VmHWM"],
        "start_s": coord.start_s, "bytes_in": statistics.median(x["bytes_in"] for x in timed),
        "bytes_out": statistics.median(x["bytes_out"] for x in timed),
        "coordinator_cpu_s": statistics.median(x["coordinator_cpu_s"] for x in timed),
        "client_cpu_s": statistics.median(x["client_cpu_s"] for x in timed),
        "heartbeats": len(rtts), "heartbeat_p50_s": statistics.median(rtts) if rtts else math.nan,
        "heartbeat_max_s": rtts[-1] if rtts else math.nan, "heartbeat_failed": len(beats.failures) if beats else 0,
        "heartbeat_failures": beats.failures[:5] if beats else [], "rounds": records,
        "vmhwm_at_stop": end_mem["VmHWM"],
    }


# ---------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    model_fields, n_params = choose_model(args.params)
    model_bytes = FP32 * n_params
    base_cfg = scale_config(model_fields, Path(tempfile.gettempdir()), 1, 1, args.overrides)  # a bad --set: here
    block, level = base_cfg.codec.block, base_cfg.codec.push_level()  # the islands' pushes (int8)
    pool = min(FRAME_POOL, max(args.sizes))
    log(f"model {n_params:,} params ({model_bytes / MB:.1f} MB fp32): "
        + " ".join(f"{k}={v}" for k, v in model_fields.items())
        + f"; islands {args.sizes}; {args.warmup} warm-up + {args.rounds} timed rounds each; {CODEC} frames; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    frames = make_frames(CODEC, n_params, pool, block, level) if 1 in args.shards else []
    frame_bytes = statistics.fmean(len(f) for f in frames) if frames else 0.0
    log(f"{pool} frames encoded: {frame_bytes / MB:.1f} MB each; island threads pull at most "
        f"{pulls_at_once(max(args.sizes), frame_bytes)} at once")
    work = Path(tempfile.mkdtemp(prefix="dtrain-scale-"))
    by_shards: dict[int, list[dict[str, Any]]] = {s: [] for s in args.shards}
    baseline: int | None = None
    floor: dict[str, Any] | None = None
    loads = [os.getloadavg()[0]]
    try:
        if not args.no_baseline:
            baseline = runtime_baseline(work)
        for s in args.shards:
            cut = frames if s == 1 else range_frames(n_params, pool, block, level, shard_plan(base_cfg, work, s))
            if s > 1:
                frame_bytes = statistics.fmean(len(f) for f in cut)
            for n in args.sizes:
                by_shards[s].append(run_size(model_fields, n_params, cut, n, args.rounds, args.warmup, work,
                                             args.overrides, shards=s))
                loads.append(os.getloadavg()[0])
            del cut
        if not args.no_floor and 1 in args.shards:
            top = max(by_shards[1], key=lambda r: r["islands"])
            floor = transport_floor(frames, top["islands"], args.rounds, int(top["bytes_out"] // top["islands"]),
                                    scale_config(model_fields, work, top["islands"], 1, args.overrides), work)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = by_shards[args.shards[0]]
    f = figures(rows, model_bytes, baseline)
    f["shards"] = args.shards[0]
    if floor is not None:
        f["floor"] = floor_figures(floor, n_params)
    if len(args.shards) > 1:
        top = max(args.sizes)
        one = next(r for r in by_shards[args.shards[0]] if r["islands"] == top)
        most = next(r for r in by_shards[args.shards[-1]] if r["islands"] == top)
        f["shard_speedup"] = one["round_s"] / most["round_s"]
        f["shard_speedup_of"] = [args.shards[0], args.shards[-1]]
        f["shard_cpu_ratio"] = most["coordinator_cpu_s"] / one["coordinator_cpu_s"]
    wall = time.perf_counter() - t_start
    print(f"\nmodel: {n_params:,} params ({model_bytes / MB:.1f} MB fp32; "
          + ", ".join(f"{k}={v}" for k, v in model_fields.items())
          + f"); {CODEC} frames of {statistics.fmean(len(x) for x in frames) / MB:.1f} MB; sync mode, min_quorum = "
            f"all islands; median of {args.rounds} rounds after {args.warmup} warm-up; {os.cpu_count()} CPUs "
            f"shared by the coordinator and every island thread; load average {min(loads):.2f}-{max(loads):.2f}")
    for s, shard_rows in by_shards.items():
        print(f"-- {s} coordinator shard{'s' * (s > 1)}" + (" (cpu s: every shard's; RSS, in/out: the lead's)"
                                                            if s > 1 else ""))
        print("\n".join(table(shard_rows, model_bytes, baseline)))
        if s > 1:
            print("   per shard cpu s: " + "; ".join(f"{r['islands']} islands: "
                                                    + ", ".join(f"{c:.2f}" for c in r["shard_cpu_s"])
                                                    for r in shard_rows))
    base_txt = f"{baseline / (1 << 20):.0f} MiB, a no-model coordinator's VmHWM" if baseline else "not measured"
    print(f"   round s = first push starts -> every island holds the new version; peak RSS = the coordinator's "
          f"VmHWM over the rounds; RSS/model = peak / (4 x params); net/model = (peak - {base_txt}) / (4 x params); "
          f"in/out = frame bytes per round; cpu s per round: coordinator, island threads; hb = heartbeat round trips")
    print("   idle RSS after the joins: " + ", ".join(f"{r['islands']}: {r['idle_rss'] / (1 << 20):.0f} MiB"
                                                       for r in rows))
    print(f"slope: {f['slope']:.4f} round-s per island (least squares over {len(rows)} sizes); per island: "
          + ", ".join(f"{r['islands']}: {r['round_s'] / r['islands'] * 1e3:.1f} ms" for r in rows))
    if f["net_rss_over_model"] is not None:
        print(f"memory at {f['islands']} islands: raw {f['rss_over_model']:.2f}, net of the runtime "
              f"{f['net_rss_over_model']:.2f} model sizes")
    if floor is not None:
        ff = f["floor"]
        print(f"floor at {floor['islands']} islands (the same frames, chunks and pulls, nothing else done): a bare "
              f"gRPC server {floor['server_cpu_s']:.2f} CPU s a round -> {fmt_or_na(ff['wire'], '.3g')} params/core-s; "
              + ("the frames are stored (no zstd), nothing to decode: the ceiling is the wire's "
                 if floor.get("stored") else
                 f"zstd decoding a frame {floor['decode_cpu_s']:.3f} CPU s -> {fmt_or_na(ff['decode'], '.3g')}; "
                 "both: ")
              + f"{fmt_or_na(ff['ceiling'], '.3g')} params/core-s; the coordinator: "
              f"{fmt_or_na(f['params_per_core_s'], '.3g')}")
    print(f"wall {wall:.0f}s")
    out = {"model": {**model_fields, "params": n_params, "fp32_bytes": model_bytes}, "codec": CODEC,
           "rounds": args.rounds, "warmup": args.warmup, "baseline_vmhwm": baseline, "rows": rows, "figures": f,
           "rows_by_shards": {str(s): r for s, r in by_shards.items()},
           "floor": floor, "load_average": loads, "wall_s": wall}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(targets_line(f))
    if "shard_speedup" in f:
        a, b = f["shard_speedup_of"]
        print(f"shards: round time with {a} shard(s) / with {b} at {max(args.sizes)} islands: "
              f"{f['shard_speedup']:.2f} (target >= {SHARD_SPEEDUP_MIN:g}, for shards on hosts of their own: these "
              f"share {os.cpu_count()} CPUs) {met(f['shard_speedup'] >= SHARD_SPEEDUP_MIN)}; coordinator CPU s "
              f"{b} / {a} shard(s): {f['shard_cpu_ratio']:.2f}")
    print(final_line(f))
    return out


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/scale.py", main))
