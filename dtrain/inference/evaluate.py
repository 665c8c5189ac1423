"""``dtrain eval``: a run's loss and perplexity on a token store's held-out split, as the run computes its own.

The batches are the run's (:func:`dtrain.train.prepare.held_out`: the split, ``data.eval_batches`` batches of
``train.base_batch`` windows) and the loss is the run's function (:func:`dtrain.steps.inner.eval_loss`, what every
island's and ``dtrain train``'s eval jits): on the run's own store the figure is the run's eval figure for the same
θ, to float rounding (the run may have split the batches over several devices).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from dtrain.config.load import replace
from dtrain.data.corpus import existing_store, open_corpus
from dtrain.inference.load import Loaded, LoadError
from dtrain.steps.inner import eval_loss
from dtrain.train.prepare import held_out

__all__ = ["HeldOut", "held_out_loss"]


@dataclass(frozen=True)
class HeldOut:
    """The loss (nats per token) and perplexity of a model on a store's held-out split, and what it was taken on."""

    loss: float
    perplexity: float
    store: str
    batches: int
    tokens: int  # next-token predictions averaged


def held_out_loss(model: Loaded, store: str | None = None) -> HeldOut:
    """The run's eval on ``store``'s held-out split (None: the run's own store), with the run's data settings
    (``data.max_bytes``, ``eval_fraction``, ``eval_batches``, ``document_masking``) and batch. LoadError for a
    Hugging Face folder (no run settings say which batches) or a run whose store is not there."""
    run, root = model.run, model.run_dir
    if run is None or root is None:
        raise LoadError(f"{model.source}: eval needs a run folder with its run_started event (the run's data "
                        "settings and batch size say which batches its eval figure is taken on)")
    cache = Path(run.data.cache).expanduser() if run.data.cache else root.parent / "data-cache"
    if store is None:
        store = existing_store(run.data, cache)
        if store is None:
            raise LoadError(f"the run's data source {run.data.source!r} has no token store under {cache}: name "
                            "one with --data STORE")
    cfg = replace(run, data={"source": store}, model=dataclasses.asdict(model.cfg))
    corpus = open_corpus(cfg.data, cfg.model.vocab_size, cache)
    _, batches = held_out(corpus, cfg)
    loss = float(jax.jit(partial(eval_loss, apply=model.built.apply))(model.params, jnp.asarray(batches)))
    return HeldOut(loss=loss, perplexity=math.exp(loss) if loss < 700 else math.inf, store=store,
                   batches=batches.shape[0], tokens=batches.shape[0] * batches.shape[1] * cfg.model.seq_len)
