"""DiLoCo vs one island vs synchronous data parallel, side by side in one run.

The DiLoCo paper's protocol (arXiv 2311.08105, section 3): every method starts
from the same warm-started model (a shared single-island warm-up of W steps),
then runs the same number of inner steps T on the same data:

  (a) single: one island, batch B (the same wall-clock as one DiLoCo island, 1/N of the tokens);
  (b) dp:     synchronous data parallel over N islands: one update per step on the N*B batch
              (what an all-reduce every step gives); N*B*T tokens;
  (c) diloco: N islands, H inner steps each, R = T/H rounds of outer Nesterov SGD; N*B*T tokens.

Island i reads the same shard in (b) and (c); (a) reads island 0's shard. Each
method gets a fresh inner AdamW whose warm-up + cosine schedule spans T steps.

Bytes are what each method would put on the network, both directions, fp32:
dp sends its gradient and receives the mean every step (2 x 4P per island per
step); diloco pushes its pseudo-gradient each round and pulls the new θ before
every round but the first (4P each way). Last line:

  convergence: islands=N H=H rounds=R diloco/dp eval-loss ratio=X diloco/single ratio=Y comm reduction=Cx
    int8/fp32=.. int8 comm reduction=..x int4/fp32=.. int4 comm reduction=..x sparse/fp32=.. sparse comm reduction=..x
    fragments/fp32=.. fragments peak-bytes=..x

(sparse: SparseLoCo, the sparse codec both ways, outer.rule=sparseloco; its update's density per round is logged.
fragments: the sparse variant with outer.fragments = --fragments (Streaming DiLoCo): each island pushes one fragment
every H/F steps, round robin, through the same merger; peak-bytes is the largest exchange of one island (its push
plus the update it pulls) over the sparse variant's.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "")  # before JAX: no fake devices here, one CPU device per process


import jax
import numpy as np
from _common import log

from coordinator import admission
from coordinator.merge_types import MergeOptions
from coordinator.merger import Merger
from coordinator.records import PushInfo
from dtrain import codec
from dtrain.config.load import load_config, replace
from dtrain.config.sections import CODEC_NAMES, Config, ConfigError
from dtrain.steps.inner import make_mesh
from dtrain.steps.outer import OuterHParams, feedback_decay, suited_rule
from dtrain.train import fragments
from dtrain.train.diloco import ConcatStream, Island, advance, diloco_round, init_outer, record_loss, round_lengths
from dtrain.train.loop import InnerLoop
from dtrain.train.prepare import prepare
from dtrain.train.runs import FP32_BYTES
from dtrain_cli.entry import Parser, run_main

PLAIN_ARMS = {"optimizers": "adamw", "codecs": "int8,int4,sparse", "only": "single,dp,diloco"}
BITS_ARMS = {"optimizers": "adamw,muon", "codecs": "int8,int4,int2,sparse,mask", "only": "dp,diloco"}  # --bits

MODES = {
    # name: (warm-up steps W, inner steps H, rounds R)
    "quick": (400, 50, 8),
    "default": (400, 25, 48),
}


def round_screen(merger: Merger, cfg: Config, steps: int) -> dict:
    """The coordinator's round screen (``coordinator.admission.screen_round``) on the merger's pending pushes, as
    ``coordinator.rounds_loop`` runs it before a step (with ``screened_mean``, each push's direction too): the
    pushes it rejects are dropped, not trained again (an honest run should reject none). Returns the round's
    cosines and the keys rejected."""
    pending = merger.pending
    cosines, reference = merger.direction_cosines() if merger.opts.rule == "screened_mean" else (None, "")
    infos = [PushInfo(p.key, p.key, 0, 1, steps, 0, 0, i) for i, p in enumerate(pending)]
    rejected = [push_id for push_id, _ in admission.screen_round(cfg.coordinator, infos, [p.norm for p in pending],
                                                                 cosines, reference)]
    merger.drop_pending(rejected)
    return {"cosines": cosines, "min_cosine": min(cosines) if cosines else math.nan, "rejected": rejected}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="benchmarks/convergence.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"W,H,R = {MODES['quick']} (under 10 minutes on 2 cores)")
    p.add_argument("--config", default="small", help="config file or name (default: small)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--warmup", type=int, default=None, help="shared warm-up steps W")
    p.add_argument("--H", type=int, default=None, help="inner steps per round")
    p.add_argument("--rounds", type=int, default=None, help="outer rounds R (T = H * R)")
    p.add_argument("--only", default=None, help="comma-separated subset of methods (default single,dp,diloco)")
    p.add_argument("--optimizers", default=None, help="(default adamw) comma-separated inner optimizers (adamw, "
                   "muon): dp, diloco and every codec variant run under each, side by side (muon's rows are named "
                   "muon-...; "
                   "train.muon_lr and the other muon fields from the config or --set)")
    p.add_argument("--bits", action="store_true", help="the optimizer x codec comparison: --optimizers adamw,muon "
                   "--codecs int8,int4,int2,sparse,mask --only dp,diloco in the default protocol (unless --quick; "
                   "any of these three flags given explicitly narrows it to those arms), ending with the line "
                   "'bits: best=OPTIMIZER+CODEC comm-reduction=R loss-ratio=L muon/adamw=M'")
    p.add_argument("--codec-optimizers", default="", help="comma-separated: the optimizers the codec variants run "
                   "under (default '': every one of --optimizers; e.g. --bits --codecs sparse --codec-optimizers "
                   "muon --only diloco: fp32 AdamW- and Muon-DiLoCo and Muon's sparse variant, three arms)")
    p.add_argument("--codecs", default=None, help="(default int8,int4,sparse) DiLoCo variants through the "
                   "production codec + merger path (both directions quantized, error feedback; sparse: SparseLoCo, "
                   "the sparse codec "
                   "both ways with outer.rule=sparseloco and the config's codec.density, codec.sparse_bits, "
                   "outer.sparseloco_lr and outer.sparseloco_beta; mask: the mask codec both ways, index-free "
                   "shared selection of codec.mask_density of the values a round, on the same rule); '' for none")
    p.add_argument("--fragments", type=int, default=0, help="outer.fragments of the fragments variant (the sparse "
                   "variant cut into F fragments; run when the codecs hold sparse and F > 1; H must be a multiple); "
                   "default 4, skipped when 4 does not divide H (the quick protocol's H = 50: add --H 48)")
    p.add_argument("--sparse-rule", choices=("sparseloco", "nesterov"), default="sparseloco",
                   help="the outer rule of the sparse and mask variants (default sparseloco: SparseLoCo); every dense "
                   "codec "
                   "runs the rule that suits it, dtrain.steps.outer.suited_rule (nesterov)")
    p.add_argument("--sparse-down", choices=CODEC_NAMES, default="sparse",
                   help="codec.down of the sparse variant (default sparse: the update in the sparse codec too; fp32: "
                   "the mean of the sparse pushes broadcast exactly, to tell the down path's loss from the up path's)")
    p.add_argument("--merge-rules", default="", help="comma-separated coordinator.merge_rule values (mean, "
                   "trimmed_mean, median, clipped_mean, screened_mean): each codec variant is run once per rule, "
                   "side by side (named diloco-CODEC-RULE), for the fault-free cost of a robust rule; '': the "
                   "config's rule")
    p.add_argument("--process", action="store_true", help="also compare `dtrain simulate` (real coordinator and "
                   "worker processes, int8) with --inprocess, both from scratch on the same config")
    p.add_argument("--document-masking", action="store_true",
                   help="also run plain diloco with data.document_masking on (documents kept apart) from the same "
                   "warm start and data: its eval loss on the plain eval batches and on documents kept apart")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--reuse", default="", metavar="JSON[,JSON]", help="arms already run, taken from these --json "
                   "files of the same protocol (W, H, R, islands: checked) instead of run again, e.g. the fp32 "
                   "arms of --bits run in one process while a codec arm runs in another; an arm this run makes "
                   "wins over a reused one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    defaults = BITS_ARMS if args.bits else PLAIN_ARMS  # a flag given explicitly wins (e.g. --bits --only diloco)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    optimizers = [o for o in args.optimizers.split(",") if o]
    mode = "quick" if args.quick else "default"
    W, H, R = MODES[mode]
    W = args.warmup if args.warmup is not None else W
    H = args.H or H
    R = args.rounds or R
    N = args.islands
    T = H * R
    fragments_on = "sparse" in args.codecs.split(",") and (args.fragments or 4) > 1 and not args.bits
    no_fragments = ""  # said once the config and data are known good (a bad one is one line)
    if fragments_on and H % (args.fragments or 4):
        if args.fragments:
            raise ConfigError(f"--fragments {args.fragments} must divide the inner steps H = {H} (set --H "
                              f"to a multiple, or --fragments 1 for no fragments variant)")
        fragments_on = False
        no_fragments = f"no fragments variant: 4 fragments do not divide H = {H} (--H 48 --fragments 4 runs it)"
    args.fragments = args.fragments or 4
    base = load_config(args.config, args.overrides)
    B = base.train.batch_size
    t0 = time.perf_counter()
    # Shared setup: corpus, island shards, eval batches. Warm-up reads all shards side by side.
    warm_cfg = replace(base, train={"steps": max(W, 2),
                                    "warmup_steps": min(base.train.warmup_steps, max(W - 1, 0))},
                       outer={"inner_steps": min(base.outer.inner_steps, max(W, 2))})  # H <= steps
    s = prepare(warm_cfg, islands=N)
    streams = [sh.stream for sh in s.shards]
    log(f"model {s.n_params:,} params; corpus {s.corpus.description}; N={N} B={B}x{base.model.seq_len} "
        f"W={W} H={H} R={R} T={T}")
    if no_fragments:
        log(no_fragments)

    params0 = s.loop.init_params(base.run.seed)
    codec_runs = [c for c in args.codecs.split(",") if c] and (
        not args.codec_optimizers or set(optimizers) & set(args.codec_optimizers.split(",")))
    trains = bool(set(args.only.split(",")) & {"single", "dp", "diloco"} or codec_runs or args.document_masking
                  or fragments_on)
    if not trains:  # --reuse alone: the table over earlier runs' arms, no warm-up
        params_w, cursor0 = params0, 0
    elif W > 0:
        warm = Island(index=0, state=s.loop.init_state(params0), stream=ConcatStream(streams))
        advance(s.loop, warm, W, B, record_loss)
        params_w = warm.state.params
        cursor0 = warm.cursor // N  # sequences each shard gave to the warm-up
    else:
        params_w, cursor0 = params0, 0
    if trains:
        log(f"warm-up: {W} steps, eval loss {s.loop.evaluate(params_w, s.eval_batches):.4f}")

    phase = replace(base, train={"steps": T}, outer={"inner_steps": H})
    mesh = make_mesh(phase)
    model_bytes = s.n_params * FP32_BYTES
    results: dict[str, dict] = {}
    only = set(args.only.split(","))

    def eval_curve(loop: InnerLoop, island: Island, batch: int) -> list[float]:
        curve = []
        for steps in round_lengths(T, H):
            advance(loop, island, steps, batch, record_loss)
            curve.append(loop.evaluate(island.state.params, s.eval_batches))
        return curve

    if "single" in only:
        loop = InnerLoop(phase, s.built, mesh)
        isl = Island(index=0, state=loop.init_state(params_w), stream=streams[0], cursor=cursor0)
        curve = eval_curve(loop, isl, B)
        results["single"] = {"eval_loss": curve[-1], "curve": curve, "tokens": isl.tokens, "bytes": 0}
        log(f"single: eval loss {curve[-1]:.4f}")

    for opt in optimizers:
        ph = replace(phase, train={"optimizer": opt})
        prefix = "" if opt == "adamw" else f"{opt}-"  # AdamW's rows keep their names
        if "dp" in only:
            dp_cfg = replace(ph, train={"batch_size": N * B})
            loop = InnerLoop(dp_cfg, s.built, make_mesh(dp_cfg))
            isl = Island(index=0, state=loop.init_state(params_w), stream=ConcatStream(streams),
                         cursor=cursor0 * N)
            curve = eval_curve(loop, isl, N * B)
            results[f"{prefix}dp"] = {"eval_loss": curve[-1], "curve": curve, "tokens": isl.tokens,
                                      "bytes": T * N * 2 * model_bytes, "optimizer": opt}
            log(f"{prefix}dp: eval loss {curve[-1]:.4f}")

        if "diloco" in only:
            loop = InnerLoop(ph, s.built, mesh)
            hp = OuterHParams.from_config(ph, mode="sync")
            g = init_outer(loop.place_params(params_w))
            islands = [Island(index=i, state=loop.init_state(params_w), stream=streams[i], cursor=cursor0)
                       for i in range(N)]
            curve = []
            for steps in round_lengths(T, H):
                g, _ = diloco_round(loop, g, islands, steps, B, hp, record_loss)
                curve.append(loop.evaluate(g.params, s.eval_batches))
            rounds = len(curve)
            results[f"{prefix}diloco"] = {"eval_loss": curve[-1], "curve": curve,
                                          "tokens": sum(i.tokens for i in islands),
                                          "bytes": N * (2 * rounds - 1) * model_bytes, "optimizer": opt}
            log(f"{prefix}diloco: eval loss {curve[-1]:.4f}")

        rules = [r for r in args.merge_rules.split(",") if r] or [base.coordinator.merge_rule]
        if args.codec_optimizers and opt not in args.codec_optimizers.split(","):
            continue
        for name, rule in [(name, rule) for name in [c for c in args.codecs.split(",") if c] for rule in rules]:
            label = f"{prefix}diloco-{name}" + (f"-{rule}" if args.merge_rules else "")
            results[label] = codec_variant(ph, s, mesh, params_w, streams, cursor0, args, name, rule, T, H)
            results[label]["optimizer"] = opt
            log(f"{label}: eval loss {results[label]['eval_loss']:.4f}, {results[label]['bytes']:,} bytes on the "
                f"wire")

    if args.document_masking:
        results["diloco-documents"] = documents_variant(phase, warm_cfg, N, params_w, cursor0, s.eval_batches, T, H)
        log(f"diloco-documents: eval loss {results['diloco-documents']['eval_loss']:.4f} (plain eval batches), "
            f"{results['diloco-documents']['eval_loss_documents']:.4f} (documents kept apart)")

    if fragments_on:
        results["diloco-fragments"] = fragments_variant(phase, s, mesh, params_w, streams, cursor0, args, T, H)
    for path in [p for p in args.reuse.split(",") if p]:
        reused = reuse_arms(path, results, {"islands": N, "H": H, "rounds": R, "warmup": W})
        log(f"reused from {path}: {', '.join(reused) or 'nothing (every arm of it ran here)'}")

    # Communication, both directions per island. dp: a ring all-reduce of the fp32 gradient every step moves
    # 2(N-1)/N x 4 bytes per parameter each way. DiLoCo: pushed delta + pulled update per round (on the wire
    # for the codec variants; fp32 for plain diloco). The one full pull at join is left out of both.
    ring = T * 2 * (2 * (N - 1) / N) * 4 * s.n_params * N
    for opt in optimizers:
        prefix = "" if opt == "adamw" else f"{opt}-"
        if f"{prefix}dp" in results:
            results[f"{prefix}dp"]["bytes"] = int(ring)
        if f"{prefix}diloco" in results:
            results[f"{prefix}diloco"]["bytes"] = int(len(round_lengths(T, H)) * N * 2 * 4 * s.n_params)
    print(f"\n{'method':<22} {'final eval loss':>15} {'vs diloco':>9} {'tokens':>11} {'bytes (both ways)':>18} "
          f"{'dp/this':>8}   eval loss per round")
    base_loss = results.get("diloco", {}).get("eval_loss")
    for name, r in results.items():
        curve = " ".join(f"{x:.3f}" for x in r["curve"][:: max(1, len(r["curve"]) // 8)])
        rel = f"{r['eval_loss'] / base_loss:9.4f}" if base_loss else " " * 9
        red = f"{ring / r['bytes']:7.0f}x" if r["bytes"] else "       -"
        print(f"{name:<22} {r['eval_loss']:>15.4f} {rel} {r['tokens']:>11,} {r['bytes']:>18,} {red}   {curve}")
    settings = (f"W={W} H={H} R={R} T={T} N={N} batch={B}x{base.model.seq_len} inner lr={base.train.lr} "
          f"warmup={base.train.warmup_steps} outer lr={base.outer.lr} momentum={base.outer.momentum} "
          f"nesterov={base.outer.nesterov}; muon lr={base.train.muon_lr} beta={base.train.muon_beta}; "
          f"sparse: density={base.codec.density} chunk={base.codec.sparse_chunk} "
          f"bits={base.codec.sparse_bits} down density={base.codec.down_density} mask density="
          f"{base.codec.mask_density} "
          f"sparseloco lr={base.outer.sparseloco_lr} "
          f"beta={base.outer.sparseloco_beta} mask lr={base.outer.mask_lr} beta={base.outer.mask_beta}")
    for name, r in results.items():
        r.setdefault("settings", settings)  # what a later --reuse of this arm prints
        if r["settings"] != settings:
            print(f"settings of the reused arm {name}: {r['settings']}")
    print(f"\nsettings: {settings}; wall {time.perf_counter() - t0:.0f}s")
    out = {"islands": N, "H": H, "rounds": R, "warmup": W, "results": results}
    if "diloco" in results and (len(optimizers) > 1 or args.bits):
        out["table"] = optimizer_table(results, optimizers, [c for c in args.codecs.split(",") if c], ring)
    if args.process:
        out["process"] = compare_process_mode(base, N, log)
    if {"single", "dp", "diloco"} <= results.keys():
        x = results["diloco"]["eval_loss"] / results["dp"]["eval_loss"]
        y = results["diloco"]["eval_loss"] / results["single"]["eval_loss"]
        c = results["dp"]["bytes"] / results["diloco"]["bytes"]
        out.update(x=x, y=y, comm_reduction=c)
        extra = ""
        for name in ("int8", "int4", "sparse"):
            if f"diloco-{name}" in results:
                r = results[f"diloco-{name}"]
                extra += (f" {name}/fp32={r['eval_loss'] / results['diloco']['eval_loss']:.4f}"
                          f" {name} comm reduction={ring / r['bytes']:.0f}x")
        if "diloco-fragments" in results and "diloco-sparse" in results:
            r = results["diloco-fragments"]
            peak = r["peak_exchange_bytes"] / results["diloco-sparse"]["peak_exchange_bytes"]
            out.update(fragments_peak=peak)
            extra += (f" fragments/fp32={r['eval_loss'] / results['diloco']['eval_loss']:.4f}"
                      f" fragments peak-bytes={peak:.2f}x")
        if "process" in out:
            extra += f" process/inprocess={out['process']['ratio']:.4f}"
        if "diloco-documents" in results:
            ratio = results["diloco-documents"]["eval_loss"] / results["diloco"]["eval_loss"]
            extra += f" documents/diloco={ratio:.4f}"
        print(f"convergence: islands={N} H={H} rounds={R} diloco/dp eval-loss ratio={x:.3f} "
              f"diloco/single ratio={y:.3f} comm reduction={c:.0f}x{extra}")
    if args.merge_rules and len(rules) > 1:
        for name in [c for c in args.codecs.split(",") if c]:
            ref = results[f"diloco-{name}-{rules[0]}"]["eval_loss"]
            print(f"merge rules ({name}): " + " ".join(
                f"{rule}={results[f'diloco-{name}-{rule}']['eval_loss'] / ref:.4f}" for rule in rules)
                  + f" (final eval loss over {rules[0]}'s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.bits and "table" in out:
        rows = out["table"]
        meeting = [r for r in rows if r["reduction"] >= TARGET_REDUCTION]
        best = min(meeting, key=lambda r: r["ratio"]) if meeting else max(rows, key=lambda r: r["reduction"])
        muon = results.get("muon-diloco", {}).get("eval_loss", math.nan) / results["diloco"]["eval_loss"]
        out.update(best=best, muon_over_adamw=muon)
        print(f"bits: best={best['optimizer']}+{best['codec']} comm-reduction={best['reduction']:.0f}x "
              f"loss-ratio={best['ratio']:.4f} muon/adamw={muon:.4f}")
    return out


TARGET_REDUCTION, TARGET_RATIO = 3000.0, 1.01  # the target: this much less traffic than dp at this loss ratio


def optimizer_table(results: dict, optimizers: list[str], codecs: list[str], ring: float) -> list[dict]:
    """Prints every optimizer x codec pair side by side: its final eval loss over fp32 AdamW-DiLoCo's, over data
    parallel's with the same optimizer, its traffic reduction against data parallel, and whether it meets the
    target (TARGET_REDUCTION less traffic at no more than TARGET_RATIO of fp32 AdamW-DiLoCo's loss); then, for
    each codec pair, where its loss goes: its loss over fp32 DiLoCo's with the same optimizer per round, and per
    round the push stage's and the update stage's relative errors (``codec_variant``). Returns the rows."""
    ref = results["diloco"]["eval_loss"]
    rows = []
    print(f"\n{'optimizer':<9} {'codec':<7} {'eval loss':>9} {'/fp32 adamw-diloco':>18} {'/dp same opt':>12} "
          f"{'traffic reduction':>17}  meets target (>= {TARGET_REDUCTION:.0f}x at <= {TARGET_RATIO})")
    for opt in optimizers:
        prefix = "" if opt == "adamw" else f"{opt}-"
        dp = results.get(f"{prefix}dp", {}).get("eval_loss")
        for name in ("fp32", *codecs):
            r = results.get(f"{prefix}diloco" if name == "fp32" else f"{prefix}diloco-{name}")
            if r is None:
                continue
            row = {"optimizer": opt, "codec": name, "eval_loss": r["eval_loss"], "ratio": r["eval_loss"] / ref,
                   "dp_ratio": r["eval_loss"] / dp if dp else math.nan, "reduction": ring / r["bytes"]}
            row["meets"] = row["reduction"] >= TARGET_REDUCTION and row["ratio"] <= TARGET_RATIO
            rows.append(row)
            print(f"{opt:<9} {name:<7} {row['eval_loss']:>9.4f} {row['ratio']:>18.4f} {row['dp_ratio']:>12.4f} "
                  f"{row['reduction']:>16.0f}x  {'yes' if row['meets'] else 'no'}")
    print("\nwhere the loss goes, per round: loss / fp32 DiLoCo's with the same optimizer; push error ||sent - "
          "delta|| / ||delta|| (island error feedback carries it); update error ||u - sent|| / ||sent||")
    for opt in optimizers:
        prefix = "" if opt == "adamw" else f"{opt}-"
        fp32 = results.get(f"{prefix}diloco")
        for name in codecs:
            r = results.get(f"{prefix}diloco-{name}")
            if r is None or fp32 is None:
                continue
            step = max(1, len(r["curve"]) // 8)
            ratios = [a / b for a, b in zip(r["curve"], fp32["curve"], strict=True)][::step]
            print(f"  {opt}+{name} ({r['outer_rule']}): loss ratio " + " ".join(f"{x:.4f}" for x in ratios)
                  + "; push error " + " ".join(f"{x:.3f}" for x in r["up_error"][::step])
                  + "; update error " + " ".join(f"{x:.3f}" for x in r["down_error"][::step]))
    return rows


def codec_variant(phase, s, mesh, params_w, streams: list, cursor0: int, args: argparse.Namespace, name: str,
                  rule: str, T: int, H: int) -> dict:
    """DiLoCo through the production codec and merger path: synchronous rounds, both directions in the codec
    ``name`` with error feedback (sparse: ``--sparse-down`` down), the outer rule that suits the codec
    (``dtrain.steps.outer.suited_rule``; ``--sparse-rule`` for sparse), the merge rule ``rule``. Besides the eval
    curve, where the loss goes, per round: ``up_error``, the pushes' mean relative error ||sent - Δ_i|| / ||Δ_i||
    (what the island's error feedback carries to the next round), and ``down_error``, the update's relative error
    against the merger's exact update ||u - sent|| / ||sent|| (the down residual's change; 0 when lossless)."""
    N, B, k = args.islands, phase.train.batch_size, phase.codec
    loop = InnerLoop(phase, s.built, mesh)
    spec, theta_w = codec.flatten(jax.device_get(params_w))
    down = args.sparse_down if name == "sparse" else name
    merge_cfg = replace(phase, codec={"up": name, "down": down, "error_feedback": True},
                        coordinator={"mode": "sync", "merge_rule": rule},
                        outer={"rule": args.sparse_rule if name in ("sparse", "mask") else suited_rule(name)})
    merger = Merger(theta_w.copy(), MergeOptions.from_config(merge_cfg))
    bits, block = k.scheme(name)
    feedback = [codec.ErrorFeedback(theta_w.size, bits, block, feedback_decay(merge_cfg), k.density_of(name))
                if bits != 32 else None for _ in range(N)]
    islands = [Island(index=i, state=loop.init_state(params_w), stream=streams[i], cursor=cursor0)
               for i in range(N)]
    global_vec, wire, curve, density, screened, peak = theta_w.copy(), 0, [], [], [], 0
    up_error, down_error = [], []

    def down_residual() -> np.ndarray:
        path = merger.state_files().get("residual")
        return np.fromfile(path, "<f4") if path else np.zeros(0, np.float32)

    for steps in round_lengths(T, H):
        pushed, errors = 0, []  # the round's largest push; each push's relative error
        for isl, ef in zip(islands, feedback, strict=True):
            isl.state = loop.with_params(isl.state, codec.unflatten(spec, global_vec))
            before = isl.tokens
            advance(loop, isl, steps, B, record_loss)
            _, local = codec.flatten(jax.device_get(isl.state.params))
            delta = global_vec - local
            seed = merger.version  # the mask codec's: the version the islands trained from
            q = ef.compress(delta, seed) if ef else codec.quantize(delta, bits, block, k.density_of(name), seed)
            errors.append(float(np.linalg.norm(codec.dequantize(q) - delta) / max(np.linalg.norm(delta), 1e-30)))
            frame = codec.encode(q, k.zstd_level)
            wire += len(frame)  # push
            pushed = max(pushed, len(frame))
            with merger.spool() as spool:
                spool.write(frame)
                merger.validate(spool)
                merger.add_pending(spool, isl.tokens - before, key=f"island-{isl.index}")
        up_error.append(float(np.mean(errors)))
        screened.append(round_screen(merger, merge_cfg, steps))
        residual_before = down_residual()
        update = merger.outer_step()
        wire += N * len(update.frame)  # every island pulls the update
        peak = max(peak, pushed + update.size)
        density.append(update_density(update.frame, global_vec.size))
        applied = codec.dequantize(codec.decode(update.frame, expected_n=global_vec.size))
        change = down_residual() - residual_before if residual_before.size else np.zeros(1, np.float32)
        down_error.append(float(np.linalg.norm(change) / max(np.linalg.norm(applied), 1e-30)))
        global_vec = global_vec + applied
        assert np.array_equal(global_vec, merger.theta)  # islands hold the coordinator's θ bit for bit
        curve.append(loop.evaluate(codec.unflatten(spec, global_vec), s.eval_batches))
        log(f"diloco-{name} round {len(curve) - 1}: eval loss {curve[-1]:.4f}, {wire:,} bytes so far, push error "
            f"{up_error[-1]:.3f}, update error {down_error[-1]:.3f}")
    out = {"eval_loss": curve[-1], "curve": curve, "tokens": sum(i.tokens for i in islands), "bytes": wire,
           "merge_rule": rule, "round_screen": screened, "peak_exchange_bytes": peak, "up_error": up_error,
           "down_error": down_error, "outer_rule": merge_cfg.outer.rule}
    if rule == "screened_mean":
        log(f"diloco-{name}: direction screen, the lowest cosine of each round: "
            + " ".join(f"{r['min_cosine']:.3f}" for r in screened)
            + f"; pushes rejected: {sum(len(r['rejected']) for r in screened)}")
    if codec.is_sparse(bits) and down == "sparse":  # (a dense update has no density to log)
        out["update_density"] = density
        log(f"diloco-{name}: update density per round (push density {k.max_count / block:.4f}): "
            + " ".join(f"{d:.4f}" for d in density))
    return out


def documents_variant(phase, warm_cfg, N: int, params_w, cursor0: int, plain_evals, T: int, H: int) -> dict:
    """Plain diloco (fp32, synchronous rounds) with ``data.document_masking`` on: the same shards, windows and warm
    start as the diloco method, the batches carrying positions. Its curve is on the plain eval batches (the figure
    the other methods give); ``eval_loss_documents`` is its final eval with documents kept apart."""
    kept = prepare(replace(warm_cfg, data={"document_masking": True}), islands=N)
    phase_kept = replace(phase, data={"document_masking": True})
    loop = InnerLoop(phase_kept, kept.built, make_mesh(phase_kept))
    plain = InnerLoop(phase, kept.built, make_mesh(phase))
    hp = OuterHParams.from_config(phase_kept, mode="sync")
    g = init_outer(loop.place_params(params_w))
    islands = [Island(index=i, state=loop.init_state(params_w), stream=kept.shards[i].stream, cursor=cursor0)
               for i in range(N)]
    curve = []
    for steps in round_lengths(T, H):
        g, _ = diloco_round(loop, g, islands, steps, phase.train.batch_size, hp, record_loss)
        curve.append(plain.evaluate(plain.place_params(g.params), plain_evals))
    return {"eval_loss": curve[-1], "curve": curve, "tokens": sum(i.tokens for i in islands),
            "bytes": len(curve) * N * 2 * 4 * kept.n_params,  # as the diloco method counts its fp32 rounds
            "eval_loss_documents": loop.evaluate(g.params, kept.eval_batches)}


def fragments_variant(phase, s, mesh, params_w, streams: list, cursor0: int, args: argparse.Namespace, T: int,
                      H: int) -> dict:
    """The sparse variant with outer.fragments = F (Streaming DiLoCo), through the production merger: every H/F
    steps each island pushes fragment v mod F of its Δ (that fragment's own error feedback), the merger merges it
    into version v + 1, and each island folds the new θ in on that fragment (``dtrain.train.fragments.at_push``; no
    overlap: the fragment becomes θ' exactly, the others keep their local progress). Evaluated every H steps."""
    F, N, B, k = args.fragments, args.islands, phase.train.batch_size, phase.codec  # main checked F divides H
    loop = InnerLoop(phase, s.built, mesh)
    spec, theta_w = codec.flatten(jax.device_get(params_w))
    merge_cfg = replace(phase, codec={"up": "sparse", "down": "sparse", "error_feedback": True},
                        coordinator={"mode": "sync", "merge_rule": phase.coordinator.merge_rule},
                        outer={"rule": args.sparse_rule, "fragments": F})
    merger = Merger(theta_w.copy(), MergeOptions.from_config(merge_cfg, spec))
    ranges = merger.opts.ranges
    bits, block = k.scheme("sparse")
    feedback = [[codec.ErrorFeedback(r.size, bits, block, feedback_decay(merge_cfg), k.density) for r in ranges]
                for _ in range(N)]
    islands = [Island(index=i, state=loop.init_state(params_w), stream=streams[i], cursor=cursor0)
               for i in range(N)]
    global_vec, wire, curve, peak = theta_w.copy(), 0, [], 0
    for r, steps in enumerate(round_lengths(T, H // F)):
        part = merger.next_fragment()
        pushed, locals_ = 0, []
        for isl, ef in zip(islands, feedback, strict=True):
            before = isl.tokens
            advance(loop, isl, steps, B, record_loss)
            _, local = codec.flatten(jax.device_get(isl.state.params))
            locals_.append(local)
            frame = codec.encode(ef[part.index].compress((global_vec - local)[part.start:part.end]), k.zstd_level)
            wire += len(frame)
            pushed = max(pushed, len(frame))
            with merger.spool(part.index) as spool:
                spool.write(frame)
                merger.validate(spool)
                merger.add_pending(spool, isl.tokens - before)
        update = merger.outer_step()
        wire += N * update.size
        peak = max(peak, pushed + update.size)
        values = codec.dequantize(codec.decode(update.frame, expected_n=part.size))
        new_global = fragments.apply_update(global_vec, values, update.version, ranges)
        assert np.array_equal(new_global, merger.theta)  # islands hold the coordinator's θ bit for bit
        for isl, local in zip(islands, locals_, strict=True):  # the fold-in, without overlap
            folded = fragments.at_push(local, new_global, part)  # θ' on the merged fragment, local elsewhere
            isl.state = loop.with_params(isl.state, codec.unflatten(spec, folded))
        global_vec = new_global
        if (r + 1) % F == 0:
            curve.append(loop.evaluate(codec.unflatten(spec, global_vec), s.eval_batches))
    log(f"diloco-fragments: F={F} sizes {[p.size for p in ranges]}: eval loss {curve[-1]:.4f}, {wire:,} bytes on "
        f"the wire, peak exchange {peak:,} bytes")
    return {"eval_loss": curve[-1], "curve": curve, "tokens": sum(i.tokens for i in islands), "bytes": wire,
            "fragments": F, "peak_exchange_bytes": peak}


def reuse_arms(path: str, results: dict, protocol: dict) -> list[str]:
    """Adds to ``results`` the arms of an earlier ``--json`` file that ``results`` lacks, after checking that it
    ran the same protocol; returns their names."""
    with open(path) as f:
        earlier = json.load(f)
    other = {k: earlier.get(k) for k in protocol}
    if other != protocol:
        raise ConfigError(f"--reuse {path}: its protocol {other} is not this run's {protocol}")
    names = [name for name in earlier["results"] if name not in results]
    results.update({name: earlier["results"][name] for name in names})
    return names


def update_density(frame: bytes, n: int) -> float:
    """The fraction of the values a sparse update frame carries (0 for a dense one)."""
    q = codec.decode(frame, expected_n=n)
    if not codec.is_sparse(q.bits):
        return 0.0
    return float(np.frombuffer(q.payload, "<u2", count=q.scales.size).sum()) / n


def compare_process_mode(base, N: int, log) -> dict:
    """`dtrain simulate` (a coordinator and N worker processes, int8, overlap) vs --inprocess, same config."""
    import tempfile

    from dtrain.train.runs import run_simulate_inprocess
    from dtrain_cli.simulate import run_simulation

    with tempfile.TemporaryDirectory() as tmp:
        cfg = replace(base, run={"out_dir": tmp}, outer={"islands": N})
        inproc = run_simulate_inprocess(replace(cfg, run={"name": "inprocess"}), N, quiet=True)
        log(f"in-process simulate: eval loss {inproc['final_eval_loss']:.4f} in {inproc['wall_s']:.0f}s")
        procs = run_simulation(replace(cfg, run={"name": "processes"}), N, quiet=True,
                               env={"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
        log(f"process simulate: eval loss {procs['final_eval_loss']:.4f} in {procs['wall_s']:.0f}s, "
            f"utilization {procs['utilization']:.3f}")
    ratio = procs["final_eval_loss"] / inproc["final_eval_loss"]
    print(f"\nprocess mode ({N} worker processes + coordinator, codec {base.codec.up}/{base.codec.down}, overlap "
          f"{base.worker.overlap}): eval loss {procs['final_eval_loss']:.4f} "
          f"vs in-process {inproc['final_eval_loss']:.4f}"
          f" (ratio {ratio:.4f}); island utilization min {procs['utilization']:.4f}; "
          f"compression {procs['compression_ratio']:.2f}x; wall {procs['wall_s']:.0f}s vs {inproc['wall_s']:.0f}s")
    return {"ratio": ratio, "process": {k: v for k, v in procs.items() if k != "islands"},
            "inprocess_eval_loss": inproc["final_eval_loss"],
            "utilization": [i["utilization"] for i in procs["islands"]]}


if __name__ == "__main__":
    sys.exit(run_main("benchmarks/convergence.py", main))
