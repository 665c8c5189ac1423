"""The ``train`` and in-process ``simulate`` commands: I/O around the pure pieces.

Both write ``RUN_DIR/events.jsonl`` and ``RUN_DIR/summary.json`` and log
progress (``dtrain.run``), and at their end θ for ``dtrain export``
(``RUN_DIR/theta/``, ``RUN_DIR/model.json``: ``dtrain.models.layout``).
``train`` is one island on the whole train split, with orbax checkpoints
and exact ``--resume``; ``simulate --inprocess`` is N islands with
the exact DiLoCo math in one process (they share the process's devices).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from dtrain.checkpoint import Checkpointer, CheckpointError
from dtrain.config.load import replace, run_path
from dtrain.config.sections import Config, ConfigError
from dtrain.data.corpus import IslandShard
from dtrain.errors import DtrainError
from dtrain.models.layout import write_theta
from dtrain.runlog import RunLog, fmt_progress, fmt_rate
from dtrain.steps.outer import OuterHParams
from dtrain.train.diloco import Island, Timer, advance, diloco_round, init_outer, record_loss, round_lengths
from dtrain.train.prepare import Setup, prepare

FP32_BYTES = 4


class RunError(DtrainError):
    """A run cannot start as asked (e.g. it would overwrite another run); nothing was changed."""


run_dir = run_path


def new_run(cfg: Config) -> Config:
    """A new run never overwrites an old one: if runs/NAME exists, it becomes runs/NAME-2, -3, ..."""
    if not run_dir(cfg).exists():
        return cfg
    n = 2
    while run_dir(cfg).with_name(f"{cfg.run.name}-{n}").exists():
        n += 1
    return replace(cfg, run={"name": f"{cfg.run.name}-{n}"})


def _start_event(log: RunLog, s: Setup, mode: str, islands: int) -> None:
    log.event("run_started", mode=mode, islands=islands, config=s.cfg.to_dict(), corpus=s.corpus.description,
              corpus_digest=s.corpus.digest, params=s.n_params, devices=len(s.loop.mesh.devices.flat),
              mesh=dict(s.loop.mesh.shape), fingerprint=s.cfg.fingerprint())
    log.progress(f"{mode}: {s.n_params:,} params, {islands} island(s), mesh {dict(s.loop.mesh.shape)}, "
                 f"corpus {s.corpus.description}")


def _island_summary(isl: Island, shard: IslandShard, **extra: Any) -> dict[str, Any]:
    return {"index": isl.index, "steps": isl.steps, "tokens": isl.tokens, "cursor": isl.cursor,
            "final_train_loss": isl.last_loss, "shard_tokens": [shard.start, shard.stop],
            "data_wait_s": shard.stream.wait_s, **extra}


def run_train(cfg: Config, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """One island, the plain baseline; orbax checkpoints; ``resume`` continues the latest one exactly."""
    if resume:
        out = run_dir(cfg)
        if not (out / "checkpoints").is_dir() or not any((out / "checkpoints").iterdir()):
            raise RunError(f"--resume: no checkpoint in {out / 'checkpoints'} to resume from")
    else:
        cfg = new_run(cfg)
        out = run_dir(cfg)
    ckpt_dir = out / "checkpoints"
    s = prepare(cfg, islands=1)
    log = RunLog(out, quiet=quiet)
    timer = Timer()
    t = cfg.train
    island = Island(index=0, state=s.loop.init_state(s.loop.init_params(cfg.run.seed)), stream=s.shards[0].stream)
    ckpt = Checkpointer(ckpt_dir, keep=cfg.run.keep_checkpoints)
    if resume:
        _restore(cfg, ckpt, ckpt_dir, island, log)
    _start_event(log, s, "train", 1)

    boundaries = tuple(sorted({b for every in (cfg.run.log_every, cfg.run.eval_every, cfg.run.checkpoint_every)
                               if every for b in range(every, t.steps, every)}))
    on_chunk = _TrainChunkHook(cfg, s, log, ckpt, ckpt_dir, timer, island.tokens)
    # Plan chunks from step 0 so a resumed run fuses exactly the same steps as an uninterrupted one.
    done = island.steps
    remaining = t.steps - done
    advance(s.loop, island, remaining, t.batch_size, on_chunk,
            boundaries=tuple(b - done for b in boundaries if b > done))
    return _finish_train(cfg, s, log, ckpt, timer, island, out)


def _restore(cfg: Config, ckpt: Checkpointer, ckpt_dir: Path, island: Island, log: RunLog) -> None:
    """``train --resume``: the latest checkpoint's state, data cursor, step and token counts into ``island``;
    a checkpoint written for another model fingerprint raises CheckpointError."""
    step, state, meta = ckpt.restore(island.state)
    if meta.get("fingerprint") != cfg.fingerprint():
        raise CheckpointError(f"{ckpt_dir}/{step} was written for model fingerprint {meta.get('fingerprint')}, "
                              f"this config has {cfg.fingerprint()}: the model sections differ")
    island.state = state
    island.cursor, island.steps, island.tokens = meta["cursor"], meta["steps"], meta["tokens"]
    log.event("resumed", step=step, cursor=island.cursor, tokens=island.tokens)
    log.progress(f"resumed from checkpoint at step {step}")


class _TrainChunkHook:
    """``run_train``'s on_chunk: at log steps (and the last) a train event and a status line with the tokens/s
    since the previous one; an eval every run.eval_every steps before the last; an orbax checkpoint every
    run.checkpoint_every steps and at the last."""

    def __init__(self, cfg: Config, s: Setup, log: RunLog, ckpt: Checkpointer, ckpt_dir: Path, timer: Timer,
                 tokens: int) -> None:
        self.cfg, self.s, self.log, self.ckpt, self.ckpt_dir, self.timer = cfg, s, log, ckpt, ckpt_dir, timer
        self.last_t, self.last_tokens = timer(), tokens  # where the tokens/s of the next log step count from

    def __call__(self, isl: Island, metrics: dict[str, jax.Array]) -> None:
        run, steps, step = self.cfg.run, self.cfg.train.steps, isl.steps
        if step % run.log_every == 0 or step == steps:
            self._log_step(isl, metrics)
        if run.eval_every and step % run.eval_every == 0 and step < steps:
            ev = self.s.loop.evaluate(isl.state.params, self.s.eval_batches)
            self.log.event("eval", step=step, eval_loss=ev)
            self.log.progress(f"step {step:>6}  eval loss {ev:.4f}")
        if (run.checkpoint_every and step % run.checkpoint_every == 0) or step == steps:
            self.ckpt.save(step, isl.state, {"cursor": isl.cursor, "steps": isl.steps, "tokens": isl.tokens,
                                             "fingerprint": self.cfg.fingerprint()})
            self.log.event("checkpoint_saved", step=step, path=str(self.ckpt_dir / str(step)))

    def _log_step(self, isl: Island, metrics: dict[str, jax.Array]) -> None:
        step, steps = isl.steps, self.cfg.train.steps
        loss = float(np.asarray(metrics["loss"])[-1])  # note: host sync, only at log steps
        isl.last_loss = loss
        now = self.timer()
        rate = (isl.tokens - self.last_tokens) / max(now - self.last_t, 1e-9)
        self.last_t, self.last_tokens = now, isl.tokens
        self.log.event("train", step=step, loss=loss, grad_norm=float(np.asarray(metrics["grad_norm"])[-1]),
                       lr=self.s.loop.lr_at(step - 1), tokens=isl.tokens, tokens_per_s=rate)
        self.log.status("train", fmt_progress("train", step=step, steps=steps, loss=loss, tokens_per_s=rate),
                        done=step, total=steps)


def _finish_train(cfg: Config, s: Setup, log: RunLog, ckpt: Checkpointer, timer: Timer, island: Island,
                  out: Path) -> dict[str, Any]:
    """The end of ``run_train``: the final eval, the checkpointer closed, θ written for ``dtrain export``
    (version: the steps), the summary written and returned."""
    final_eval = s.loop.evaluate(island.state.params, s.eval_batches)
    ckpt.close()
    write_theta(cfg, out, island.steps, jax.device_get(island.state.params))
    wall = timer()
    log.event("eval", step=island.steps, eval_loss=final_eval)
    summary = {
        "mode": "train", "final_eval_loss": final_eval, "rounds": 0, "tokens": island.tokens, "bytes_up": 0,
        "bytes_down": 0, "wall_s": wall, "params": s.n_params, "steps": island.steps,
        "islands": [_island_summary(island, s.shards[0])], "corpus": s.corpus.description, "run_dir": str(out),
    }
    log.event("run_finished", final_eval_loss=final_eval, wall_s=wall)
    log.write_summary(summary)
    log.progress(f"done: eval loss {final_eval:.4f} after {island.steps} steps, {island.tokens:,} tokens, "
                 f"{wall:.1f}s -> {out / 'summary.json'}")
    log.close()
    return summary


def run_simulate_inprocess(cfg: Config, islands: int, quiet: bool = False) -> dict[str, Any]:
    """N islands in one process with the exact DiLoCo math; each has its own optimizer state and data.
    ConfigError with outer.fragments > 1: the in-process rounds exchange the whole θ (fragments run with worker
    processes and a coordinator)."""
    if cfg.outer.fragments > 1:
        raise ConfigError(f"outer.fragments = {cfg.outer.fragments} needs worker processes (the in-process "
                          f"rounds exchange the whole θ every outer.inner_steps): drop --inprocess")
    cfg = new_run(cfg)
    out = run_dir(cfg)
    s = prepare(cfg, islands)
    log = RunLog(out, quiet=quiet)
    _start_event(log, s, "simulate-inprocess", islands)
    timer = Timer()
    t, o = cfg.train, cfg.outer
    hp = OuterHParams.from_config(cfg, mode="sync")  # the in-process rounds are synchronous
    params0 = s.loop.init_params(cfg.run.seed)
    global_state = init_outer(params0)
    isl = [Island(index=i, state=s.loop.init_state(params0), stream=s.shards[i].stream) for i in range(islands)]
    for island in isl:
        log.event("island_joined", island=island.index,
                  shard_tokens=[s.shards[island.index].start, s.shards[island.index].stop])
    model_bytes = s.n_params * FP32_BYTES
    bytes_up = [0] * islands
    bytes_down = [0] * islands
    lengths = round_lengths(t.steps, o.inner_steps)
    final_eval = float("nan")
    for r, steps in enumerate(lengths):
        if r > 0:  # every island pulls the new θ (fp32) before its next round; round 0 starts from the seed
            for i in range(islands):
                bytes_down[i] += model_bytes
        t_round = timer()
        tokens_before = sum(i.tokens for i in isl)
        global_state, res = diloco_round(s.loop, global_state, isl, steps, t.batch_size, hp, record_loss)
        for i in range(islands):
            bytes_up[i] += model_bytes  # each island pushes its fp32 pseudo-gradient
        final_eval = s.loop.evaluate(global_state.params, s.eval_batches)
        rate = (sum(i.tokens for i in isl) - tokens_before) / max(timer() - t_round, 1e-9)
        log.event("round_merged", round=r + 1, version=res.version, inner_steps=steps, weights=res.weights,
                  delta_norms=res.deltas_norm, train_losses=res.train_losses, eval_loss=final_eval,
                  tokens=sum(i.tokens for i in isl), bytes_up=sum(bytes_up), bytes_down=sum(bytes_down))
        log.progress(f"round {r + 1:>3}/{len(lengths)}  v{res.version}  train loss "
                     f"{np.mean(res.train_losses):.4f}  eval loss {final_eval:.4f}  tok/s {fmt_rate(rate)}")
    write_theta(cfg, out, int(global_state.version), jax.device_get(global_state.params))  # for dtrain export
    wall = timer()
    summary = {
        "mode": "simulate-inprocess", "final_eval_loss": final_eval, "rounds": len(lengths),
        "tokens": sum(i.tokens for i in isl), "bytes_up": sum(bytes_up), "bytes_down": sum(bytes_down),
        "wall_s": wall, "params": s.n_params, "version": int(global_state.version),
        "islands": [_island_summary(i, s.shards[i.index], bytes_up=bytes_up[i.index],
                                    bytes_down=bytes_down[i.index]) for i in isl],
        "corpus": s.corpus.description, "run_dir": str(out),
    }
    log.event("run_finished", final_eval_loss=final_eval, wall_s=wall)
    log.write_summary(summary)
    log.progress(f"done: {len(lengths)} rounds, eval loss {final_eval:.4f}, {summary['tokens']:,} tokens, "
                 f"{(sum(bytes_up) + sum(bytes_down)) / 1e6:.1f} MB exchanged, {wall:.1f}s "
                 f"-> {out / 'summary.json'}")
    log.close()
    return summary
