"""``dtrain.load(path)``: a run folder or a Hugging Face folder as a model to look at (:class:`Loaded`).

A folder is read as the first of these it is:

- a Hugging Face folder: ``config.json`` and safetensors weights (:func:`dtrain.models.hf.folder_config`, then
  the checked read of :func:`dtrain.models.hf.load_params`), its ``tokenizer.json`` if there is one;
- a run with ``model.json`` (``dtrain simulate``, ``dtrain coordinator``, and a finished ``dtrain train`` or
  ``simulate --inprocess`` run, which writes its final θ there): θ of the newest version on disk (or
  ``version``), read as ``dtrain export`` reads them (:mod:`dtrain.models.stored`);
- a ``dtrain train`` run without it (stopped before its end): the parameters of its newest orbax checkpoint in
  ``checkpoints/`` (or step ``version``), the model from its ``run_started`` event.

A run's tokenizer is its token store's (:func:`dtrain.data.corpus.run_tokenizer`), or the byte tokenizer when its
ids are bytes. An unfinished ``simulate --inprocess`` run keeps no θ on disk: refused, one line saying so.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtrain import codec, schema
from dtrain.config.sections import Config, ModelConfig
from dtrain.data.run_tokenizer import run_tokenizer
from dtrain.data.token_store import DataError
from dtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from dtrain.errors import DtrainError
from dtrain.models import hf
from dtrain.models.model import BuiltModel, Params, build
from dtrain.models.stored import LAYOUT, read_layout, theta_file
from dtrain.runlog import read_events

__all__ = ["LoadError", "Loaded", "load"]


class LoadError(DtrainError):
    """A folder that cannot be looked at as asked, or ids a model cannot take: one line naming what is wrong."""


@dataclass
class Loaded:
    """A model to look at: its config, its parameters (float32, on the default device), its tokenizer (None: the
    folder has none, :attr:`tokenizer_note` says why) and where they came from. :meth:`logits` runs it."""

    cfg: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    tokenizer_note: str
    source: str  # in words: the folder, and the version or step read
    run: Config | None = None  # a run folder's config (from its run_started event), None for a Hugging Face folder
    run_dir: Path | None = None
    built: BuiltModel = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.built = build(self.cfg)

    @cached_property
    def _apply(self) -> Any:
        return jax.jit(self.built.apply)

    def check_ids(self, ids: Any, extra: int = 0) -> np.ndarray:
        """``ids`` as int32 ``[batch, length]``, or LoadError naming what is wrong with them: not an integer array,
        not 2-D, empty, an id outside the vocabulary, or (a GPT, whose positions are learned) longer, with
        ``extra`` tokens still to come, than its ``seq_len``."""
        arr = np.asarray(ids)
        if not np.issubdtype(arr.dtype, np.integer):
            raise LoadError(f"ids must be an integer array, got {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise LoadError(f"ids must have shape [batch, length] with both at least 1, got {list(arr.shape)}")
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= self.cfg.vocab_size:
            raise LoadError(f"ids must lie in [0, {self.cfg.vocab_size}) (the model's vocabulary), got "
                            f"{low if low < 0 else high}")
        if self.cfg.kind == "gpt" and arr.shape[1] + extra > self.cfg.seq_len:
            raise LoadError(f"{arr.shape[1] + extra} positions: the GPT has learned positions for {self.cfg.seq_len} "
                            "(model.seq_len) only")
        return arr.astype(np.int32)

    def logits(self, ids: Any) -> np.ndarray:
        """fp32 logits ``[batch, length, vocab]`` of a NumPy int array of ids ``[batch, length]`` (causal: position
        ``l`` sees ids ``0..l``)."""
        tokens = self.check_ids(ids)
        return np.asarray(self._apply(self.params, jnp.asarray(tokens)), dtype=np.float32)


def load(path: str | Path, version: int | None = None) -> Loaded:
    """The model in ``path``: a Hugging Face folder, a coordinator's run folder or a ``dtrain train`` run folder
    (see the module's docstring); ``version``: a run's θ version or checkpoint step (default: the newest on
    disk). LoadError, one line, for a missing folder, one that is none of these, or one whose θ is not there."""
    root = Path(path)
    if not root.is_dir():
        raise LoadError(f"{root}: no such folder (a run folder or a Hugging Face model folder was expected)")
    try:
        if (root / "config.json").is_file():
            if version is not None:
                raise LoadError(f"{root}: a Hugging Face folder holds one version: drop --version")
            return _hf_folder(root)
        if (root / LAYOUT).is_file():
            return _coordinator_run(root, version)
        if (root / "checkpoints").is_dir():
            return _train_run(root, version)
    except hf.HFError as e:
        raise LoadError(str(e)) from None
    mode = (_started(root) or {}).get("mode")
    if mode == "simulate-inprocess":
        raise LoadError(f"{root}: this `simulate --inprocess` run left no θ on disk (it writes its final θ when it "
                        "finishes): nothing to load")
    raise LoadError(f"{root}: neither a run folder ({LAYOUT} of a coordinator's run, or checkpoints/ of a `dtrain "
                    "train` run) nor a Hugging Face model folder (config.json and safetensors weights)")


def _looked_at(cfg: ModelConfig) -> ModelConfig:
    """The model as this host computes it: cuDNN attention, a GPU kernel, becomes XLA's off a GPU (a compute
    knob: the same model)."""
    if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
        return dataclasses.replace(cfg, attention="xla")
    return cfg


def _hf_folder(root: Path) -> Loaded:
    cfg = _looked_at(hf.folder_config(root))
    params = hf.load_params(dataclasses.replace(cfg, init_from=str(root)), build(cfg).abstract_params)
    tokenizer, note = _folder_tokenizer(root)
    return Loaded(cfg, jax.device_put(params), tokenizer, note, f"Hugging Face folder {root}")


def _folder_tokenizer(root: Path) -> tuple[Tokenizer | None, str]:
    vocab = root / "tokenizer.json"
    if not vocab.is_file():
        return None, f"{root} has no tokenizer.json"
    eos = None
    try:
        eos = json.loads((root / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return HFTokenizer.from_file(vocab, eos=eos if isinstance(eos, str) else None), f"tokenizer: {vocab}"
    except DataError as e:
        return None, f"{vocab} is not usable: {e}"


def _started(root: Path) -> dict[str, Any] | None:
    """The run's ``run_started`` event, None without one."""
    try:
        events = read_events(root, skip_torn=True, missing_ok=True)
    except OSError:
        return None
    return next((e for e in events if e.get("event") == "run_started"), None)


def _run_config(root: Path) -> Config | None:
    started = _started(root)
    if started is None or not isinstance(started.get("config"), dict):
        return None
    try:
        return schema.load(Config, started["config"], partial=True)
    except ValueError as e:
        raise LoadError(f"{root}/events.jsonl: its run_started config does not load: {e}") from None


def _run_tokenizer(cfg_data: Any, root: Path) -> tuple[Tokenizer | None, str]:
    found = run_tokenizer(cfg_data, root)
    if found.bytes:
        return ByteTokenizer(), "the byte tokenizer (the run's ids are bytes)"
    if found.file is None:
        return None, found.note
    try:
        text = found.file.read_text(encoding="utf-8")
        from tokenizers import Tokenizer as HF

        eos = HF.from_str(text).id_to_token(found.eos_id) if found.eos_id is not None else None
        return HFTokenizer(text, eos, where=str(found.file)), found.note
    except (OSError, DataError, Exception) as e:  # tokenizers raises plain Exceptions for a file that does not parse
        return None, f"{found.file} is not usable: {e}"


def _coordinator_run(root: Path, version: int | None) -> Loaded:
    model, data, spec = read_layout(root)
    version, path = theta_file(root, spec, version)
    params = codec.unflatten(spec, np.fromfile(path, "<f4"))
    tokenizer, note = _run_tokenizer(data, root)
    run = _run_config(root)
    return Loaded(_looked_at(model), jax.device_put(params), tokenizer, note, f"run {root}, version {version}",
                  run=run, run_dir=root)


def _train_run(root: Path, step: int | None) -> Loaded:
    from dtrain.checkpoint import Checkpointer, CheckpointError
    from dtrain.steps.inner import TrainState, make_optimizer

    run = _run_config(root)
    if run is None:
        raise LoadError(f"{root}: a `dtrain train` run folder without its run_started event in events.jsonl: "
                        "the model it trained is unknown")
    built = build(run.model)
    tx = make_optimizer(run.train)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p)),
                              built.abstract_params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
    ckpt = Checkpointer(root / "checkpoints", async_save=False)
    try:
        if step is not None and step not in ckpt.steps():
            raise LoadError(f"step {step} is not kept in {root / 'checkpoints'}: the steps on disk are "
                            f"{', '.join(map(str, ckpt.steps())) or 'none'}")
        step, state, _ = ckpt.restore(abstract, step)
    except CheckpointError as e:
        raise LoadError(str(e)) from None
    finally:
        ckpt.close()
    tokenizer, note = _run_tokenizer(run.data, root)
    return Loaded(_looked_at(run.model), state.params, tokenizer, note, f"run {root}, step {step}", run=run,
                  run_dir=root)
