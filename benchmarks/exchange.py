"""Exchange throughput: dtrain's push-and-merge next to raw Python gRPC on loopback; compression; coordinator memory.

One run measures, for one model (25M parameters by default, 100M with --full;
a real GPT config: configs/small.toml with model overrides):

  1. raw gRPC ceiling: a minimal Python gRPC server in its own process, a generic
     client-streaming method with identity (bytes) serializers; 1, 4, 8 client
     threads (one channel each, the options dtrain's client uses), each streaming
     one fp32 delta's worth of bytes (4·P) in codec.chunk_bytes chunks at once.
     bytes/s = all bytes sent / (last call returns − first call starts).
  2. dtrain push-and-merge: ``dtrain coordinator`` as a separate process
     (``python -m dtrain_cli coordinator``), one per (codec, N); N island threads,
     each with its own CoordinatorClient, join, then all push one fabricated delta
     (random normal × 1e-3, encoded with dtrain.codec before timing) at once. The
     interval runs from the first push's start until the last push returns MERGED
     (the round's outer step done). wire MB/s = frame bytes / s; model MB/s =
     N·4·P / s (fp32 bytes of deltas merged per second).
  3. compression ratio per codec (codec.compression_ratio) on an actual
     pseudo-gradient θ0 − θ20 (20 AdamW steps of the same model on CPU, batch 4),
     or on a gaussian delta with --delta gaussian; with the encode (quantize +
     frame) and decode (checked decode + dequantize) throughput of each codec in
     MB/s of fp32 input, best of 3, the sparse codec (codec.density of each
     codec.sparse_chunk, codec.sparse_bits bits) beside int8.
  4. the coordinator's peak RSS (VmHWM, read just before SIGTERM) over the model's
     fp32 size, per run; also net of a no-model coordinator's VmHWM (the runtime).
  5. where the coordinator's CPU goes per pushed frame (in this process, one
     thread, the same Merger code): parsing the chunk messages; chunk checks +
     the one streaming decode (every code checked) + spooling the decompressed
     body; the end-of-frame checks (CRC, sizes); summing one push into Δ (done
     by the outer step's threads); and the outer step itself.
  6. the merge with every island's push pending (in this process, the same
     Merger code): the CPU and wall seconds of spooling the N pushes (decode,
     check, norm, write) and of one outer step summing them, for each
     ``coordinator.merge_threads`` in --merge-threads (the second of two rounds:
     files written over, as in a running coordinator); params/core-s = N x
     params / (spool + outer step CPU s), gRPC left out.
  Per round, the CPU seconds of the coordinator process and of the client
  threads (this process) are read from /proc and os.times() around the round.

The throughput runs use coordinator.checkpoint=false; one extra int8 run with
checkpointing on (not used in the summary) shows what it costs. Last line:

  exchange: int8 ratio=X 4bit ratio=Y merge/raw-grpc throughput=Z coordinator peak-rss/model=M

Z = dtrain int8 push-and-merge throughput in model (fp32-equivalent) bytes/s with
8 islands / raw gRPC bytes/s with 8 streams; M = VmHWM / (4·P) for int8, 8 islands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX: this benchmark is about the host side

import numpy as np
from _common import (
    FP32,
    MB,
    ROOT,
    CoordinatorProcess,
    RawServer,
    choose_model,
    codec_list,
    cpu_seconds,
    int_list,
    log,
    make_config,
    make_frames,
    model_overrides,
    param_count,
    proc_mem,
    run_concurrently,
    runtime_baseline,
)

TARGETS = {"int8_ratio": (">=", 3.9), "int4_ratio": (">=", 7.5), "merge_over_raw": (">=", 0.5),
           "peak_rss_over_model": ("<=", 3.0)}


# -- arguments and the model ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dtrain_cli.entry import Parser  # one-line usage errors, as every entry point's

    p = Parser(prog="benchmarks/exchange.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the 100M-parameter model (d_model=1024, n_layers=8)")
    p.add_argument("--islands", type=int_list, default=[1, 4, 8], help="island / stream counts (default 1,4,8)")
    p.add_argument("--codecs", type=codec_list, default=["fp32", "int8", "int4"],
                   help="codecs pushed (codec.up) (default fp32,int8,int4)")
    p.add_argument("--params", type=param_count, default=None, metavar="N",
                   help="quick runs: a model of about N parameters (d_model searched, n_layers 8 from 8M up, else 2)")
    p.add_argument("--d-model", type=int, default=None, help="with or without --params: this d_model")
    p.add_argument("--n-layers", type=int, default=None, help="with or without --params: this many layers")
    p.add_argument("--merge-threads", type=int_list, default=[1, 2],
                   help="coordinator.merge_threads values the merge of section 6 is timed with (default 1,2)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed rounds per (codec, N) and per stream count; the best is reported (default 2)")
    p.add_argument("--delta", choices=("trained", "gaussian"), default="trained",
                   help="delta for the compression ratios: θ0−θ20 of a short CPU training run, or gaussian")
    p.add_argument("--no-checkpoint-run", action="store_true",
                   help="skip the extra int8 run with coordinator.checkpoint=true")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the no-model coordinator whose VmHWM is the runtime baseline")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field of the coordinator's config (repeatable; after the benchmark's own)")
    p.add_argument("--keep", action="store_true", help="keep the temporary run folders (logs, events)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


# -- 1. raw gRPC ------------------------------------------------------------------------------------


def bench_raw(n_params: int, chunk_bytes: int, max_msg: int, streams: list[int], repeats: int,
              work: Path) -> list[dict[str, Any]]:
    server = RawServer(work / "raw", max_msg)
    try:
        per_stream = FP32 * n_params
        blob = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes()
        full, rem = divmod(per_stream, chunk_bytes)
        chunks = [blob] * full + ([blob[:rem]] if rem else [])
        rows = []
        for n in streams:
            channels = [server.channel() for _ in range(n)]
            for ch in channels:  # connect first (dtrain's islands have joined before they push)
                server.push(ch, [b"x"], timeout=60)
            walls = []
            for _ in range(repeats):
                res = run_concurrently(n, lambda i, channels=channels: server.push(channels[i], chunks))
                for _, _, got in res:
                    if got != per_stream:
                        raise RuntimeError(f"raw server counted {got} bytes, sent {per_stream}")
                walls.append(max(t1 for _, t1, _ in res) - min(t0 for t0, _, _ in res))
                log(f"raw gRPC: {n} stream(s) x {per_stream / MB:.1f} MB: {walls[-1]:.2f}s "
                    f"({n * per_stream / walls[-1] / MB:.0f} MB/s)")
            for ch in channels:
                ch.close()
            best = min(walls)
            rows.append({"streams": n, "bytes": n * per_stream, "wall_s": best, "walls_s": walls,
                         "bytes_per_s": n * per_stream / best})
        mem = proc_mem(server.proc.pid)
        for row in rows:
            row["server_vmhwm"] = mem["VmHWM"]
        return rows
    finally:
        server.stop()


# -- 2. dtrain push-and-merge -----------------------------------------------------------------------


def bench_dtrain(cfg, frames: list[bytes], n: int, repeats: int, run_dir: Path, n_params: int) -> dict[str, Any]:
    from dtrain.net.proto import dtrain_pb2 as pb
    from workers.client import CoordinatorClient

    coord = CoordinatorProcess(cfg, run_dir)
    clients: list[Any] = []
    try:
        clients = [CoordinatorClient(coord.address, cfg) for _ in range(n)]
        joins = [c.join(f"island-{i}", "cpu", 1) for i, c in enumerate(clients)]
        if joins[0].tree_size != n_params:
            raise RuntimeError(f"the coordinator's tree has {joins[0].tree_size} values, expected {n_params}")
        tokens = cfg.train.batch_size * cfg.model.seq_len * cfg.outer.inner_steps
        seqs = cfg.train.batch_size * cfg.outer.inner_steps
        rounds = []
        for r in range(repeats):
            def push(i: int, r: int = r) -> Any:
                h = pb.PushHeader(island_id=joins[i].island_id, base_version=r, push_id=f"island-{i}-r{r}",
                                  tokens=tokens, inner_steps=cfg.outer.inner_steps, cursor_start=r * seqs,
                                  cursor_end=(r + 1) * seqs, shard_index=joins[i].shard_index,
                                  tree_digest=joins[i].tree_digest)
                return clients[i].push(h, frames[i])

            cpu0 = cpu_seconds(coord.proc.pid), sum(os.times()[:2])
            res = run_concurrently(n, push)
            cpu1 = cpu_seconds(coord.proc.pid), sum(os.times()[:2])
            statuses = [pb.PushStatus.Name(resp.status) for _, _, resp in res]
            last = max(range(n), key=lambda i: res[i][1])
            merged = [i for i, (_, _, resp) in enumerate(res) if resp.status == pb.PUSH_STATUS_MERGED]
            if merged != [last] or res[last][2].version != r + 1:
                raise RuntimeError(f"round {r}: expected exactly the last push to return MERGED into version "
                                   f"{r + 1}; got statuses {statuses}, versions {[x[2].version for x in res]}")
            wall = res[last][1] - min(t0 for t0, _, _ in res)
            wire = sum(len(frames[i]) for i in range(n))
            rounds.append({"wall_s": wall, "push_s": [t1 - t0 for t0, t1, _ in res], "statuses": statuses,
                           "coordinator_cpu_s": cpu1[0] - cpu0[0], "client_cpu_s": cpu1[1] - cpu0[1]})
            log(f"dtrain {cfg.codec.up} N={n} ckpt={'on' if cfg.coordinator.checkpoint else 'off'} round {r}: "
                f"{wall:.2f}s, wire {wire / wall / MB:.0f} MB/s, model {n * FP32 * n_params / wall / MB:.0f} MB/s; "
                f"CPU s: coordinator {cpu1[0] - cpu0[0]:.2f}, clients {cpu1[1] - cpu0[1]:.2f}")
        status = clients[0].status()
        retries = sum(c.retries for c in clients)
        if retries:
            raise RuntimeError(f"{retries} push retries happened: the timings are not clean")
    finally:
        for c in clients:
            c.close()
        mem, summary = coord.stop()
    best = min(rounds, key=lambda x: x["wall_s"])
    wire = sum(len(frames[i]) for i in range(n))
    model_bytes = n * FP32 * n_params
    return {"codec": cfg.codec.up, "islands": n, "checkpoint": cfg.coordinator.checkpoint, "wall_s": best["wall_s"],
            "coordinator_cpu_s": best["coordinator_cpu_s"], "client_cpu_s": best["client_cpu_s"],
            "walls_s": [x["wall_s"] for x in rounds], "push_s": best["push_s"], "wire_bytes": wire,
            "model_bytes": model_bytes, "wire_bytes_per_s": wire / best["wall_s"],
            "model_bytes_per_s": model_bytes / best["wall_s"], "vmhwm": mem["VmHWM"], "vmrss_end": mem["VmRSS"],
            "vmhwm_at_start": coord.mem_at_start["VmHWM"], "start_s": coord.start_s,
            "merge_s_total": summary.get("merge_s", status.merge_s), "bytes_in": status.bytes_in,
            "versions": status.version, "peak_rss_over_model": mem["VmHWM"] / (FP32 * n_params)}


# -- 3. compression ---------------------------------------------------------------------------------


def trained_delta(model_fields: dict[str, int], steps: int = 20, batch: int = 4) -> tuple[np.ndarray, str]:
    """θ0 − θ_steps of a short AdamW run of the same model on CPU: an actual pseudo-gradient."""
    import jax

    from dtrain import codec
    from dtrain.config.load import load_config
    from dtrain.train.diloco import Island, advance
    from dtrain.train.prepare import prepare

    cfg = load_config(ROOT / "configs" / "small.toml", model_overrides(model_fields) + [
        f"train.steps={steps}", f"train.warmup_steps={min(5, steps - 1)}", f"train.batch_size={batch}",
        f"train.steps_per_call={min(10, steps)}", f"outer.inner_steps={steps}", "mesh.data=1"])
    s = prepare(cfg, islands=1)
    params0 = s.loop.init_params(cfg.run.seed)
    _, v0 = codec.flatten(jax.device_get(params0))
    v0 = np.array(v0, np.float32)
    isl = Island(index=0, state=s.loop.init_state(params0), stream=s.shards[0].stream)
    advance(s.loop, isl, steps, batch)
    _, v1 = codec.flatten(jax.device_get(isl.state.params))
    v0 -= v1
    return v0, (f"θ0−θ{steps}: {steps} AdamW steps (lr {cfg.train.lr:g}, warm-up {cfg.train.warmup_steps}), "
                f"batch {batch}x{cfg.model.seq_len}, corpus {s.corpus.description}")


def push_level(codec_cfg, name: str) -> int:
    """The zstd level an island pushes codec ``name`` at (``CodecConfig.push_level`` with ``codec.up = name``)."""
    import dataclasses

    return dataclasses.replace(codec_cfg, up=name).push_level()


def ratios(delta: np.ndarray, codec_cfg, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Per codec (fp32, int8, int4, e3m0, sparse at the config's codec.density / sparse_chunk / sparse_bits): the
    frame's size and ratio, its relative L2 error, and the best of ``repeats`` timings of encode (quantize +
    frame) and decode (the checked decode + dequantize), as MB/s of fp32 input."""
    from dtrain import codec

    out = {}
    norm = float(np.linalg.norm(delta))
    for name in ("fp32", "int8", "int4", "e3m0", "sparse"):
        bits, block = codec_cfg.scheme(name)
        enc, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            q = codec.quantize(delta, bits, block, codec_cfg.density)
            frame = codec.encode(q, push_level(codec_cfg, name))
            t1 = time.perf_counter()
            values = codec.dequantize(codec.decode(frame, expected_n=delta.size))
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        err = float(np.linalg.norm(values - delta)) / norm if norm > 0 else 0.0
        out[name] = {"frame_bytes": len(frame), "ratio": codec.compression_ratio(delta.size, len(frame)),
                     "rel_l2_error": err, "encode_s": min(enc), "decode_s": min(dec),
                     "encode_mb_s": FP32 * delta.size / min(enc) / MB, "decode_mb_s": FP32 * delta.size / min(dec) / MB}
        if codec.is_sparse(bits):
            kept = int(np.count_nonzero(values))
            out[name]["bits_per_kept_value"] = 8 * len(frame) / max(kept, 1)
            out[name]["density"] = kept / delta.size
    return out


# -- 5. where the coordinator's CPU goes ----------------------------------------------------------------


def breakdown(cfg, frame: bytes, n_params: int, work: Path) -> dict[str, float]:
    """One frame through the coordinator's code path, single-threaded, timed stage by stage (with the
    coordinator's malloc settings, as in the service)."""
    import zlib

    from coordinator.memory import return_large_frees_to_the_os
    from coordinator.merge_types import MergeOptions
    from coordinator.merger import Merger

    return_large_frees_to_the_os()
    from dtrain.net.proto import dtrain_pb2 as pb
    from dtrain.net.wire import FrameReceiver, chunk_deserializer, chunk_message, frame_chunks, max_frame_bytes

    spool_dir = work / "breakdown-spool"
    merger = Merger(np.zeros(n_params, np.float32), MergeOptions.from_config(cfg), spool_dir=spool_dir)
    chunk_bytes = cfg.codec.chunk_bytes
    wire_msgs = [chunk_message(i, d, c) for i, (d, c) in enumerate(frame_chunks(frame, chunk_bytes)[1])]
    parse = chunk_deserializer(pb.PushMessage)
    out: dict[str, float] = {}
    t = time.perf_counter()
    msgs = [parse(m) for m in wire_msgs]
    out["parse"] = time.perf_counter() - t
    with merger.spool() as spool:
        t = time.perf_counter()
        receiver = FrameReceiver(len(frame), len(msgs), zlib.crc32(frame), max_frame_bytes(n_params, cfg.codec.block),
                                 chunk_bytes)
        for m in msgs:
            spool.write(receiver.add(m.chunk), m.chunk.crc32)
        receiver.finish()
        out["check_spool"] = time.perf_counter() - t
        del msgs
        t = time.perf_counter()
        merger.validate(spool)
        merger.add_pending(spool, 1.0)
        out["validate"] = time.perf_counter() - t
    t = time.perf_counter()
    merger.pending_sum()  # what the outer step's slab pass does per pending push (plus one model-sized zeros)
    out["sum"] = time.perf_counter() - t
    t = time.perf_counter()
    merger.outer_step()
    out["outer_step"] = time.perf_counter() - t
    merger.close()
    shutil.rmtree(spool_dir, ignore_errors=True)
    out["per_push"] = out["parse"] + out["check_spool"] + out["validate"] + out["sum"]
    out["serial_8"] = 8 * out["per_push"] + out["outer_step"] - out["sum"]
    return out


def merge_rate(cfg, frames: list[bytes], n_params: int, work: Path, threads: int) -> dict[str, float]:
    """Every frame of ``frames`` spooled as a push (one thread, chunk by chunk as they arrive), then one outer step
    with ``coordinator.merge_threads`` = ``threads``: CPU seconds (this process, every thread) and wall seconds of
    each, and parameters merged per core-second (pushes x params / their sum of CPU seconds). Two rounds, the
    second one timed: as in a running coordinator, its spool and state files are the first round's, written over
    (a fresh merger's first round also allocates them, and costs up to twice as much)."""
    import dataclasses

    from coordinator.merge_types import MergeOptions
    from coordinator.merger import Merger

    spool_dir = work / f"merge-rate-{threads}"
    merger = Merger(np.zeros(n_params, np.float32),
                    dataclasses.replace(MergeOptions.from_config(cfg), threads=threads), spool_dir=spool_dir)
    chunk = cfg.codec.chunk_bytes
    merger.opts = dataclasses.replace(merger.opts, spare_spools=len(frames))  # round 2 writes over round 1's spools
    try:
        for _ in range(2):  # the second round's figures are kept
            c0, t0 = time.process_time(), time.perf_counter()
            for i, frame in enumerate(frames):
                view = memoryview(frame)
                with merger.spool() as spool:
                    for start in range(0, len(frame), chunk):
                        spool.write(view[start:start + chunk])
                    merger.validate(spool)
                    merger.add_pending(spool, 1.0 + i)
            c1, t1 = time.process_time(), time.perf_counter()
            merger.outer_step()
            c2, t2 = time.process_time(), time.perf_counter()
    finally:
        merger.close()
        shutil.rmtree(spool_dir, ignore_errors=True)
    return {"threads": threads, "pushes": len(frames), "spool_cpu_s": c1 - c0, "spool_wall_s": t1 - t0,
            "step_cpu_s": c2 - c1, "step_wall_s": t2 - t1,
            "params_per_core_s": len(frames) * n_params / max(c2 - c0, 1e-9)}


# -- the run ----------------------------------------------------------------------------------------

CPU_GROWTH_MAX = 1.3  # coordinator CPU per push at the most islands / at the fewest (at least 4 of them)


def cpu_growth(runs: list[dict[str, Any]]) -> dict[str, tuple[int, int, float]]:
    """Per codec: (fewest islands measured, at least 4; most islands; coordinator CPU per push at the most / at the
    fewest), from the checkpoint-off runs; codecs with fewer than two such island counts are left out. A round's
    coordinator CPU grows with the islands, its CPU per push should not (the fp32 regression: 8x the CPU when the
    islands doubled)."""
    out = {}
    for name in dict.fromkeys(r["codec"] for r in runs):
        per = {r["islands"]: r["coordinator_cpu_s"] / r["islands"] for r in runs
               if r["codec"] == name and not r["checkpoint"] and r["islands"] >= 4}
        if len(per) >= 2:
            lo, hi = min(per), max(per)
            out[name] = (lo, hi, per[hi] / per[lo])
    return out



def _fmt_bytes(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _met(name: str, value: float) -> str:
    op, target = TARGETS[name]
    if math.isnan(value):
        return "not measured"
    ok = value >= target if op == ">=" else value <= target
    return f"{'met' if ok else 'NOT met'} (target {op} {target:g})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    model_fields, n_params = choose_model(args.params, args.d_model, args.n_layers, args.full)
    model_bytes = FP32 * n_params
    base = make_config(model_fields, Path(tempfile.gettempdir()), extra=args.overrides)  # a bad --set: here
    # Each codec's frames at the level islands push it at (codec.up_zstd_level), for the ratios and the pushes alike
    chunk, block = base.codec.chunk_bytes, base.codec.block
    levels = {name: push_level(base.codec, name) for name in ("fp32", "int8", "int4", "e3m0", "sparse")}
    max_msg = base.coordinator.max_message_bytes
    islands = sorted(set(args.islands))
    codecs = list(dict.fromkeys(args.codecs))
    log(f"model {n_params:,} params ({model_bytes / MB:.1f} MB fp32): "
        + " ".join(f"{k}={v}" for k, v in model_fields.items())
        + f"; islands {islands}, codecs {codecs}, chunk {chunk} B, block {block}, push zstd levels {levels}, "
          f"repeats {args.repeats}; {os.cpu_count()} CPUs")
    work = Path(tempfile.mkdtemp(prefix="dtrain-exchange-"))
    out: dict[str, Any] = {"model": {**model_fields, "params": n_params, "fp32_bytes": model_bytes},
                           "chunk_bytes": chunk, "block": block, "push_zstd_levels": levels, "repeats": args.repeats,
                           "cpus": os.cpu_count(), "codec_down": base.codec.down}
    try:
        # 3. compression, on the realistic delta (before anything is timed)
        if args.delta == "trained":
            log("training the model 20 steps on CPU for an actual pseudo-gradient ...")
            delta, how = trained_delta(model_fields)
        else:
            delta = np.random.default_rng(7).standard_normal(n_params, dtype=np.float32) * np.float32(1e-3)
            how = "gaussian: normal x 1e-3"
        comp = ratios(delta, base.codec)
        del delta
        gauss_comp = comp if args.delta == "gaussian" else None
        out["compression"] = {"delta": how, "codecs": comp}
        log(f"compression ({how}): " + ", ".join(f"{k} {v['ratio']:.2f}x" for k, v in comp.items()))

        # 4. the runtime's own peak RSS: a coordinator of a (nearly) empty model
        baseline = None
        if not args.no_baseline:
            baseline = out["runtime_baseline_vmhwm"] = runtime_baseline(work)

        # 1. raw gRPC ceiling
        log(f"raw gRPC: streams {islands}, {model_bytes / MB:.1f} MB each ...")
        raw = bench_raw(n_params, chunk, max_msg, islands, args.repeats, work)
        out["raw_grpc"] = raw

        # 2. + 5. dtrain push-and-merge, per codec; the CPU breakdown per frame
        runs: list[dict[str, Any]] = []
        cpu: dict[str, dict[str, float]] = {}
        merges: list[dict[str, Any]] = []
        gauss_frame_ratio: dict[str, float] = {}
        for name in codecs:
            log(f"{name}: encoding {max(islands)} fabricated deltas ...")
            frames = make_frames(name, n_params, max(islands), block, push_level(base.codec, name))
            gauss_frame_ratio[name] = model_bytes / len(frames[0])
            cfg = make_config(model_fields, work, name, 1, False, args.repeats, args.overrides)
            cpu[name] = breakdown(cfg, frames[0], n_params, work)
            log(f"{name}: per push {cpu[name]['per_push']:.2f}s CPU, outer step {cpu[name]['outer_step']:.2f}s")
            for k in args.merge_threads:
                merges.append({"codec": name, **merge_rate(cfg, frames, n_params, work, k)})
                log(f"{name}: {len(frames)} pushes merged with merge_threads={k}: "
                    f"{merges[-1]['params_per_core_s']:.3g} params/core-s")
            for n in islands:
                cfg = make_config(model_fields, work, name, n, False, args.repeats, args.overrides)
                runs.append(bench_dtrain(cfg, frames, n, args.repeats, work / f"coord-{name}-{n}", n_params))
            if name == "int8" and not args.no_checkpoint_run:
                n = max(islands)
                cfg = make_config(model_fields, work, name, n, True, args.repeats, args.overrides)
                runs.append(bench_dtrain(cfg, frames, n, args.repeats, work / f"coord-{name}-{n}-ckpt", n_params))
            del frames
        out["dtrain"] = runs
        out["coordinator_cpu_s"] = cpu
        out["merge_rate"] = merges
        out["gaussian_frame_ratio"] = gauss_frame_ratio
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    # -- tables ---------------------------------------------------------------------------------------
    wall = time.perf_counter() - t_start
    print(f"\nmodel: {n_params:,} params ({model_bytes / MB:.1f} MB fp32; "
          + ", ".join(f"{k}={v}" for k, v in model_fields.items())
          + f"); chunk {chunk:,} B; block {block}; push zstd levels {levels}; codec.down={base.codec.down}; "
            f"best of {args.repeats} rounds; {os.cpu_count()} CPUs shared by clients and server")

    print(f"\n1. compression ({how})")
    print(f"{'codec':<6} {'frame bytes':>14} {'ratio':>8} {'gauss ratio':>11} {'rel L2 err':>10} {'encode s':>9} "
          f"{'enc MB/s':>9} {'dec MB/s':>9}")
    for name, c in comp.items():
        g = (gauss_comp or {}).get(name, {}).get("ratio", gauss_frame_ratio.get(name, float("nan")))
        print(f"{name:<6} {c['frame_bytes']:>14,} {c['ratio']:>8.3f} {g:>11.3f} {c['rel_l2_error']:>10.4f} "
              f"{c['encode_s']:>9.2f} {c['encode_mb_s']:>9.0f} {c['decode_mb_s']:>9.0f}")
    sp = comp["sparse"]
    print(f"sparse: {base.codec.sparse_bits}-bit values, density {sp['density']:.4f} of chunks of "
          f"{base.codec.sparse_chunk}, {sp['bits_per_kept_value']:.2f} bits per kept value on the wire "
          "(the rel L2 error is one round's: error feedback carries the rest)")

    print("\n2. raw Python gRPC, loopback, bytes serializers (each stream sends one fp32 delta's bytes)")
    print(f"{'streams':>7} {'total bytes':>14} {'wall s':>8} {'MB/s':>8}")
    for r in raw:
        print(f"{r['streams']:>7} {r['bytes']:>14,} {r['wall_s']:>8.2f} {r['bytes_per_s'] / MB:>8.0f}")

    print("\n3. dtrain push-and-merge (coordinator process; first push start -> last push returns MERGED; "
          "throughput runs use coordinator.checkpoint=false)")
    raw_by_n = {r["streams"]: r["bytes_per_s"] for r in raw}
    print(f"{'codec':<6} {'N':>2} {'ckpt':>4} {'wire bytes':>13} {'wall s':>7} {'wire MB/s':>9} {'model MB/s':>10} "
          f"{'model/raw':>9} {'wire/raw':>8} {'peak RSS':>10} {'RSS/model':>9} {'net/model':>9} {'outer s':>7} "
          f"{'cpu/push':>8}")
    for r in runs:
        rawbps = raw_by_n.get(r["islands"], float("nan"))
        net = (r["vmhwm"] - baseline) / model_bytes if baseline else float("nan")
        r["net_peak_rss_over_model"] = net
        merge_s = r["merge_s_total"] / max(r["versions"], 1) if r["merge_s_total"] is not None else float("nan")
        print(f"{r['codec']:<6} {r['islands']:>2} {'on' if r['checkpoint'] else 'off':>4} {r['wire_bytes']:>13,} "
              f"{r['wall_s']:>7.2f} {r['wire_bytes_per_s'] / MB:>9.0f} {r['model_bytes_per_s'] / MB:>10.0f} "
              f"{r['model_bytes_per_s'] / rawbps:>9.3f} {r['wire_bytes_per_s'] / rawbps:>8.3f} "
              f"{_fmt_bytes(r['vmhwm']):>10} {r['peak_rss_over_model']:>9.2f} {net:>9.2f} {merge_s:>7.2f} "
              f"{r['coordinator_cpu_s'] / r['islands']:>8.2f}")
    print("   model MB/s = N x 4 x params / wall (fp32-equivalent bytes merged per second); ckpt on = "
          "coordinator.checkpoint=true (not used below); outer s = mean outer step (+ checkpoint) per version; "
          "cpu/push = the coordinator's CPU seconds in the round / N")
    base_txt = f"{_fmt_bytes(baseline)}, a no-model coordinator's VmHWM" if baseline else "n/a"
    print(f"   peak RSS = the coordinator's VmHWM just before SIGTERM; RSS/model = VmHWM / (4 x params); "
          f"net/model = (VmHWM - {base_txt}) / (4 x params)")
    growth = cpu_growth(runs)
    out["cpu_per_push_growth"] = growth
    for name, (n_lo, n_hi, ratio) in growth.items():
        print(f"   {name}: coordinator CPU per push at N={n_hi} / at N={n_lo}: {ratio:.2f} "
              f"({'met' if ratio <= CPU_GROWTH_MAX else 'NOT met'}: target <= {CPU_GROWTH_MAX:g}; a push costs "
              "the same however many push with it)")

    print("\n4. coordinator CPU per pushed frame, one thread, this process, seconds")
    print(f"{'codec':<6} {'parse':>7} {'decode+spool':>12} {'finish':>9} {'sum into Δ':>10} {'per push':>9} "
          f"{'outer step':>10} {'N=8 serial':>10}")
    for name, c in cpu.items():
        print(f"{name:<6} {c['parse']:>7.3f} {c['check_spool']:>12.3f} {c['validate']:>9.3f} {c['sum']:>10.3f} "
              f"{c['per_push']:>9.3f} {c['outer_step']:>10.3f} {c['serial_8']:>10.2f}")
    print("   decode+spool = chunk CRCs + the one streaming decode (all codes checked) + writing the decompressed "
          "body; sum into Δ = reading it back into the outer step's Δ (done there, on its threads); outer step = "
          "with one push pending; N=8 serial = 8 x per push + the rest of the outer step (one core, gRPC excluded)")
    print("   measured per round of section 3 (best round), CPU seconds: "
          + "; ".join(f"{r['codec']} N={r['islands']}{' ckpt' if r['checkpoint'] else ''}: coordinator "
                      f"{r['coordinator_cpu_s']:.2f}, clients {r['client_cpu_s']:.2f}" for r in runs))

    print(f"\n6. the merge of {max(islands)} pushes in this process (gRPC left out): spooling them (one thread) and "
          "one outer step summing them (a merger's second round), per coordinator.merge_threads")
    print(f"{'codec':<6} {'threads':>7} {'spool cpu s':>11} {'spool wall s':>12} {'step cpu s':>10} "
          f"{'step wall s':>11} {'params/core-s':>13}")
    for r in merges:
        print(f"{r['codec']:<6} {r['threads']:>7} {r['spool_cpu_s']:>11.3f} {r['spool_wall_s']:>12.3f} "
              f"{r['step_cpu_s']:>10.3f} {r['step_wall_s']:>11.3f} {r['params_per_core_s']:>13.3g}")
    print("   params/core-s = pushes x params / (spool + outer step CPU seconds, every thread of this process); the "
          "step's wall seconds show what its threads gain on this machine's cores")

    # -- summary ---------------------------------------------------------------------------------------
    def pick(codec_name: str, n: int, ckpt: bool = False) -> dict[str, Any] | None:
        return next((r for r in runs if r["codec"] == codec_name and r["islands"] == n and r["checkpoint"] == ckpt),
                    None)

    n_sum = 8 if 8 in islands else max(islands)
    x, y = comp["int8"]["ratio"], comp["int4"]["ratio"]
    r8 = pick("int8", n_sum)
    z = r8["model_bytes_per_s"] / raw_by_n[n_sum] if r8 else float("nan")
    z_wire = r8["wire_bytes_per_s"] / raw_by_n[n_sum] if r8 else float("nan")
    m = r8["peak_rss_over_model"] if r8 else float("nan")
    out.update(summary={"int8_ratio": x, "int4_ratio": y, "merge_over_raw": z, "merge_over_raw_wire": z_wire,
                        "peak_rss_over_model": m, "islands": n_sum, "delta": how, "wall_s": wall})
    print(f"\ntargets (int8, {n_sum} islands{'' if n_sum == 8 else ' -- 8 not measured'}; ratios on {how}):")
    print(f"  int8 compression ratio        {x:8.3f}   {_met('int8_ratio', x)}")
    print(f"  4-bit (int4) ratio            {y:8.3f}   {_met('int4_ratio', y)}")
    print(f"  merge/raw-gRPC, model bytes   {z:8.3f}   {_met('merge_over_raw', z)}")
    print(f"  merge/raw-gRPC, WIRE bytes    {z_wire:8.3f}   (the same run counted in bytes actually sent; no target)")
    print(f"  coordinator peak RSS / model  {m:8.3f}   {_met('peak_rss_over_model', m)}")
    print(f"\nwall {wall:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=float)
    i8 = comp["int8"]
    print(f"exchange codecs: int8 ratio={i8['ratio']:.2f} encode={i8['encode_mb_s']:.0f} MB/s "
          f"decode={i8['decode_mb_s']:.0f} MB/s; sparse ratio={sp['ratio']:.1f} encode={sp['encode_mb_s']:.0f} MB/s "
          f"decode={sp['decode_mb_s']:.0f} MB/s (MB/s of fp32 input)")
    print(f"exchange: int8 ratio={x:.2f} 4bit ratio={y:.2f} merge/raw-grpc throughput={z:.3f} "
          f"coordinator peak-rss/model={m:.2f}")
    return out


if __name__ == "__main__":
    from dtrain_cli.entry import run_main  # the one wrapper: a user error is one line, no traceback

    sys.exit(run_main("benchmarks/exchange.py", main))
