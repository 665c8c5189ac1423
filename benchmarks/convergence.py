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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "")  # before JAX: no fake devices here, one CPU device per process


from dtrain import config, outer  # noqa: E402
from dtrain.config import load_config  # noqa: E402
from dtrain.diloco import ConcatStream, Island, advance, diloco_round, record_loss, round_lengths  # noqa: E402
from dtrain.runs import FP32_BYTES, prepare  # noqa: E402
from dtrain.train import InnerLoop, make_mesh  # noqa: E402

MODES = {
    # name: (warm-up steps W, inner steps H, rounds R)
    "quick": (400, 50, 8),
    "default": (400, 25, 48),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"W,H,R = {MODES['quick']} (under 10 minutes on 2 cores)")
    p.add_argument("--config", default="small", help="config file or name (default: small)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--warmup", type=int, default=None, help="shared warm-up steps W")
    p.add_argument("--H", type=int, default=None, help="inner steps per round")
    p.add_argument("--rounds", type=int, default=None, help="outer rounds R (T = H * R)")
    p.add_argument("--only", default="single,dp,diloco", help="comma-separated subset of methods")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    mode = "quick" if args.quick else "default"
    W, H, R = MODES[mode]
    W = args.warmup if args.warmup is not None else W
    H = args.H or H
    R = args.rounds or R
    N = args.islands
    T = H * R
    base = load_config(args.config, args.overrides)
    B = base.train.batch_size
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    # Shared setup: corpus, island shards, eval batches. Warm-up reads all shards side by side.
    warm_cfg = config.replace(base, train={"steps": max(W, 2), "warmup_steps": min(base.train.warmup_steps, max(W - 1, 0))})
    s = prepare(warm_cfg, islands=N)
    streams = [sh.stream for sh in s.shards]
    log(f"model {s.n_params:,} params; corpus {s.corpus.description}; N={N} B={B}x{base.model.seq_len} "
        f"W={W} H={H} R={R} T={T}")

    params0 = s.loop.init_params(base.run.seed)
    if W > 0:
        warm = Island(index=0, state=s.loop.init_state(params0), stream=ConcatStream(streams))
        advance(s.loop, warm, W, B, record_loss)
        params_w = warm.state.params
        cursor0 = warm.cursor // N  # sequences each shard gave to the warm-up
    else:
        params_w, cursor0 = params0, 0
    eval_w = s.loop.evaluate(params_w, s.eval_batches)
    log(f"warm-up: {W} steps, eval loss {eval_w:.4f}")

    phase = config.replace(base, train={"steps": T})
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

    if "dp" in only:
        dp_cfg = config.replace(phase, train={"batch_size": N * B})
        loop = InnerLoop(dp_cfg, s.built, make_mesh(dp_cfg))
        isl = Island(index=0, state=loop.init_state(params_w), stream=ConcatStream(streams), cursor=cursor0 * N)
        curve = eval_curve(loop, isl, N * B)
        results["dp"] = {"eval_loss": curve[-1], "curve": curve, "tokens": isl.tokens,
                         "bytes": T * N * 2 * model_bytes}
        log(f"dp: eval loss {curve[-1]:.4f}")

    if "diloco" in only:
        loop = InnerLoop(phase, s.built, mesh)
        tx = outer.make_outer_optimizer(phase.outer)
        g = outer.init_outer(loop.place_params(params_w), tx)
        islands = [Island(index=i, state=loop.init_state(params_w), stream=streams[i], cursor=cursor0)
                   for i in range(N)]
        curve = []
        for steps in round_lengths(T, H):
            g, _ = diloco_round(loop, g, islands, steps, B, tx, record_loss)
            curve.append(loop.evaluate(g.params, s.eval_batches))
        rounds = len(curve)
        results["diloco"] = {"eval_loss": curve[-1], "curve": curve, "tokens": sum(i.tokens for i in islands),
                             "bytes": N * (2 * rounds - 1) * model_bytes}
        log(f"diloco: eval loss {curve[-1]:.4f}")

    print(f"\n{'method':<8} {'final eval loss':>15} {'tokens':>12} {'bytes sent':>14}   eval loss per round")
    for name, r in results.items():
        curve = " ".join(f"{x:.3f}" for x in r["curve"][:: max(1, len(r["curve"]) // 8)])
        print(f"{name:<8} {r['eval_loss']:>15.4f} {r['tokens']:>12,} {r['bytes']:>14,}   {curve}")
    print(f"\nsettings: W={W} H={H} R={R} T={T} N={N} batch={B}x{base.model.seq_len} inner lr={base.train.lr} "
          f"warmup={base.train.warmup_steps} outer lr={base.outer.lr} momentum={base.outer.momentum} "
          f"nesterov={base.outer.nesterov}; wall {time.perf_counter() - t0:.0f}s")
    out = {"islands": N, "H": H, "rounds": R, "warmup": W, "results": results}
    if {"single", "dp", "diloco"} <= results.keys():
        x = results["diloco"]["eval_loss"] / results["dp"]["eval_loss"]
        y = results["diloco"]["eval_loss"] / results["single"]["eval_loss"]
        c = results["dp"]["bytes"] / results["diloco"]["bytes"]
        out.update(x=x, y=y, comm_reduction=c)
        print(f"convergence: islands={N} H={H} rounds={R} diloco/dp eval-loss ratio={x:.3f} "
              f"diloco/single ratio={y:.3f} comm reduction={c:.0f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
