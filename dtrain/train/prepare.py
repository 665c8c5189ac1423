"""What every run builds before its first step: model, mesh, inner loop, corpus, shards, eval batches.

:func:`prepare` is shared by the ``train`` and in-process ``simulate`` commands
(``dtrain.train.runs``), the island worker (``workers.app``) and the benchmarks,
so all of them see the same model, the same per-island data shards and the
same fixed eval batches for a given config.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from dtrain.config.load import data_cache
from dtrain.config.sections import Config
from dtrain.data.corpus import Corpus, IslandShard, Split, eval_batches, island_shards, open_corpus, split
from dtrain.data.mixture import Mixture, mixture_eval_batches, mixture_shards, open_mixture
from dtrain.health.faults import DeviceFault
from dtrain.models import model
from dtrain.steps.inner import make_mesh
from dtrain.train.loop import InnerLoop


@dataclass
class Setup:
    cfg: Config
    built: model.BuiltModel
    loop: InnerLoop
    corpus: Corpus | Mixture  # a mixture of stores with data.sources
    shards: list[IslandShard]
    eval_batches: np.ndarray
    n_params: int


def held_out(corpus: Corpus, cfg: Config) -> tuple[Split, np.ndarray]:
    """The corpus's split and the run's fixed eval batches: every island's, and ``dtrain eval``'s."""
    parts = split(corpus, cfg.data.eval_fraction, cfg.model.seq_len)
    return parts, eval_batches(corpus, parts.eval, cfg.model.seq_len, cfg.train.base_batch,
                               cfg.data.eval_batches)  # the run's batch: every island evaluates the same


def prepare(cfg: Config, islands: int, *, per_device: bool = False, fault: DeviceFault | None = None) -> Setup:
    """Model, mesh, inner loop, corpus (opened as a token store; made under ``data.cache`` on first use), per-island
    shards and fixed eval batches. ``per_device``: the inner loop
    runs the per-device step (chip health: ``dtrain.health.device_step``), with ``fault`` injected into one device."""
    corpus: Corpus | Mixture
    if cfg.data.mixed:  # data.sources: every island's shard interleaves one shard of each store by weight
        corpus = open_mixture(cfg.data, cfg.model.vocab_size, data_cache(cfg))
        shards = mixture_shards(corpus, islands, cfg.model.seq_len, cfg.run.seed, cfg.data.eval_fraction)
        evals = mixture_eval_batches(corpus, cfg.model.seq_len, cfg.train.base_batch, cfg.data.eval_batches,
                                     cfg.data.eval_fraction)
    else:
        corpus = open_corpus(cfg.data, cfg.model.vocab_size, data_cache(cfg))
        parts, evals = held_out(corpus, cfg)
        shards = island_shards(corpus, parts.train, islands, cfg.model.seq_len, cfg.run.seed)
    built = model.build(cfg.model)
    loop = InnerLoop(cfg, built, make_mesh(cfg), per_device=per_device, fault=fault)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(built.abstract_params))
    return Setup(cfg, built, loop, corpus, shards, evals, n_params)
