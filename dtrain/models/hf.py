"""Hugging Face model folders: dtrain's parameter tree as a ``transformers`` model, and back.

A folder holds ``config.json`` and the weights as float32 safetensors: ``model.safetensors``, or past
:data:`SHARD_BYTES` the shards ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``.

- ``model.kind = "llama"`` is ``LlamaForCausalLM``: every tensor maps by name, the linear kernels transposed
  (dtrain keeps ``[in, out]``, ``torch.nn.Linear`` ``[out, in]``); RoPE is the same rotate-half convention, so
  q and k need no permutation. A tied head (``model.tie_embeddings``) has no ``lm_head.weight``.
- ``model.kind = "gpt"`` is ``GPT2LMHeadModel``, exactly: learned positions (``n_positions = seq_len``),
  LayerNorm with nnx's epsilon (:data:`GPT_LAYERNORM_EPS`), GELU's tanh approximation (``gelu_new``, what
  ``jax.nn.gelu`` computes by default), an untied head, GPT-2's ``Conv1D`` weights stored ``[in, out]`` like
  dtrain's kernels (no transpose). GPT-2 has biases on its projections where dtrain's GPT has none: they are
  exported as zeros, and a folder whose biases are not all zero is refused.
- ``model.kind = "mlp"`` has no counterpart: :func:`mapping` refuses it.

Everything works on the flat vector and its spec (``dtrain.codec.spec``), not on JAX arrays: numpy and
safetensors only, so the exporter reads the coordinator's state files without JAX. Reading uses its own
memory-mapped safetensors parser, which converts bfloat16 and float16 checkpoints to float32 without torch or
ml_dtypes. Every refusal is an :class:`HFError` whose one line names every tensor that differs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from dtrain.codec.spec import Spec
from dtrain.config.sections import ModelConfig

__all__ = ["HFError", "SHARD_BYTES", "Tensor", "export_folder", "folder_config", "hf_config", "mapping",
           "read_vector", "weight_files"]

SHARD_BYTES: Final = 5 * 10**9  # transformers' default max_shard_size, "5GB"
SINGLE: Final = "model.safetensors"
INDEX: Final = "model.safetensors.index.json"
GPT_LAYERNORM_EPS: Final = 1e-6  # flax.nnx.LayerNorm's default epsilon, which dtrain's GPT uses


class HFError(ValueError):
    """A Hugging Face folder or a model that does not map; the one-line message names every difference."""


@dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor: its name and shape, the dtrain spec path it comes from (None: a GPT-2 bias that
    dtrain has not, always zero) and whether the dtrain leaf is its transpose."""

    name: str
    shape: tuple[int, ...]
    path: str | None
    transpose: bool


_Rule = tuple[str, str, bool]  # (dtrain path regex, HF name template over its groups, transposed)

_LLAMA: Final[list[_Rule]] = [
    (r"tok_embed/embedding", "model.embed_tokens.weight", False),
    (r"blocks/(\d+)/attn_norm/scale", "model.layers.{0}.input_layernorm.weight", False),
    (r"blocks/(\d+)/attn/(q|k|v|o)/kernel", "model.layers.{0}.self_attn.{1}_proj.weight", True),
    (r"blocks/(\d+)/mlp_norm/scale", "model.layers.{0}.post_attention_layernorm.weight", False),
    (r"blocks/(\d+)/mlp/(gate|up|down)/kernel", "model.layers.{0}.mlp.{1}_proj.weight", True),
    (r"norm_f/scale", "model.norm.weight", False),
    (r"head/kernel", "lm_head.weight", True),
]
_GPT2: Final[list[_Rule]] = [
    (r"tok_embed/embedding", "transformer.wte.weight", False),
    (r"pos_embed", "transformer.wpe.weight", False),
    (r"blocks/(\d+)/ln(1|2)/(scale|bias)", "transformer.h.{0}.ln_{1}.{2}", False),
    (r"blocks/(\d+)/attn/qkv/kernel", "transformer.h.{0}.attn.c_attn.weight", False),
    (r"blocks/(\d+)/attn/proj/kernel", "transformer.h.{0}.attn.c_proj.weight", False),
    (r"blocks/(\d+)/mlp/up/kernel", "transformer.h.{0}.mlp.c_fc.weight", False),
    (r"blocks/(\d+)/mlp/down/kernel", "transformer.h.{0}.mlp.c_proj.weight", False),
    (r"ln_f/(scale|bias)", "transformer.ln_f.{0}", False),
    (r"head/kernel", "lm_head.weight", True),
]
_GPT2_BIASES: Final = (("attn.c_attn", 3), ("attn.c_proj", 1), ("mlp.c_fc", 0), ("mlp.c_proj", 1))  # 0: mlp width
# Tensors some published folders carry that are buffers, not parameters: ignored on import.
_BUFFERS: Final = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


def mapping(cfg: ModelConfig, spec: Spec) -> list[Tensor]:
    """The Hugging Face tensors of a model with this spec, in the spec's order (GPT-2's zero biases after their
    block's weights); HFError for a kind without a counterpart or a spec path outside the mapping."""
    if cfg.kind not in ("llama", "gpt"):
        raise HFError(f"model.kind = {cfg.kind!r} has no Hugging Face counterpart: only llama "
                      "(LlamaForCausalLM) and gpt (GPT2LMHeadModel) can be exported or imported")
    rules = _LLAMA if cfg.kind == "llama" else _GPT2
    out: list[Tensor] = []
    unknown = []
    for path, shape, _ in spec:
        for pattern, template, transpose in rules:
            m = re.fullmatch(pattern, path)
            if m:
                groups = [{"scale": "weight"}.get(g, g) for g in m.groups()]
                dims = tuple(int(d) for d in shape)
                out.append(Tensor(template.format(*groups), dims[::-1] if transpose else dims, path, transpose))
                break
        else:
            unknown.append(path)
    if unknown:
        raise HFError(f"the {cfg.kind} parameter tree has leaves the Hugging Face mapping does not know: "
                      f"{', '.join(unknown)}")
    if cfg.kind == "gpt":
        d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        for layer in range(cfg.n_layers):
            for module, times in _GPT2_BIASES:
                out.append(Tensor(f"transformer.h.{layer}.{module}.bias", (times * d if times else hidden,), None,
                                  False))
    return out


def _shape_of(spec: Spec, path: str) -> list[int]:
    return next(list(shape) for p, shape, _ in spec if p == path)


def hf_config(cfg: ModelConfig, spec: Spec, eos_id: int | None = None) -> dict[str, Any]:
    """``config.json`` for the model: ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (widths read off the spec)."""
    mapping(cfg, spec)  # refuses a kind without a counterpart
    head_dim = cfg.d_model // cfg.n_heads
    common: dict[str, Any] = {"vocab_size": cfg.vocab_size, "torch_dtype": "float32", "initializer_range": 0.02,
                              "use_cache": True}
    if eos_id is not None:
        common.update(eos_token_id=eos_id, bos_token_id=eos_id)
    if cfg.kind == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
                "n_head": cfg.n_heads, "n_inner": cfg.mlp_ratio * cfg.d_model, "activation_function": "gelu_new",
                "layer_norm_epsilon": GPT_LAYERNORM_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": False}
    kv_heads = _shape_of(spec, "blocks/0/attn/k/kernel")[1] // head_dim if cfg.n_layers else cfg.n_heads
    hidden = _shape_of(spec, "blocks/0/mlp/gate/kernel")[1] if cfg.n_layers else 0
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": cfg.d_model, "intermediate_size": hidden, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": cfg.tie_embeddings}


def folder_config(folder: str | Path) -> ModelConfig:
    """The model a folder's ``config.json`` describes (``LlamaForCausalLM`` or ``GPT2LMHeadModel``; what
    :func:`hf_config` writes read back), for looking at a folder (``dtrain.load``); HFError for a missing or
    unreadable config or another architecture. ``seq_len`` is the folder's context length."""
    path = Path(folder) / "config.json"
    try:
        c = json.loads(path.read_text())
        model_type = c.get("model_type")
        if model_type == "llama":
            return ModelConfig(kind="llama", vocab_size=c["vocab_size"], seq_len=c["max_position_embeddings"],
                               d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                               n_heads=c["num_attention_heads"],
                               n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                               mlp_hidden=c["intermediate_size"], rope_theta=float(c.get("rope_theta", 10000.0)),
                               norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                               tie_embeddings=bool(c.get("tie_word_embeddings", False)))
        if model_type == "gpt2":
            return ModelConfig(kind="gpt", vocab_size=c["vocab_size"], seq_len=c["n_positions"], d_model=c["n_embd"],
                               n_layers=c["n_layer"], n_heads=c["n_head"],
                               mlp_ratio=(c.get("n_inner") or 4 * c["n_embd"]) // c["n_embd"])
    except FileNotFoundError:
        raise HFError(f"{folder}: no config.json (a Hugging Face model folder has one)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HFError(f"{path}: unreadable: {type(e).__name__}: {e}") from None
    raise HFError(f"{path}: model_type {model_type!r}: only llama (LlamaForCausalLM) and gpt2 (GPT2LMHeadModel) "
                  "folders are read")


# -- writing ----------------------------------------------------------------------------------------------


def _leaves(spec: Spec, vec: np.ndarray) -> dict[str, np.ndarray]:
    """Each spec path's float32 leaf as a view into ``vec`` (a memory map: nothing is read yet)."""
    out, offset = {}, 0
    for path, shape, _ in spec:
        size = int(np.prod(shape, dtype=np.int64))
        out[path] = vec[offset:offset + size].reshape(shape)
        offset += size
    if offset != vec.size:
        raise HFError(f"θ has {vec.size} values but the spec describes {offset}")
    return out


def hf_tensors(cfg: ModelConfig, spec: Spec, vec: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of every Hugging Face tensor, one at a time (each a copy: transposed, contiguous)."""
    leaves = _leaves(spec, vec)
    for t in mapping(cfg, spec):
        if t.path is None:
            yield t.name, np.zeros(t.shape, np.float32)
        else:
            leaf = leaves[t.path]
            yield t.name, np.ascontiguousarray(leaf.T if t.transpose else leaf, dtype=np.float32)


def export_folder(cfg: ModelConfig, spec: Spec, vec: np.ndarray, out: str | Path, shard_bytes: int = SHARD_BYTES,
                  eos_id: int | None = None) -> list[str]:
    """Writes ``config.json``, ``generation_config.json`` and the float32 safetensors of θ (``vec``, flat, in
    ``spec``'s layout) into ``out`` (created; expected empty); shards past ``shard_bytes``, each shard held in
    memory only while it is written. Returns the files written."""
    from safetensors.numpy import save_file

    config = hf_config(cfg, spec, eos_id)  # refuses first, before anything is written
    tensors = mapping(cfg, spec)
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = 4 * int(np.prod(t.shape, dtype=np.int64))
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    names = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                               for i in range(len(groups))]
    stream = hf_tensors(cfg, spec, vec)
    weight_map = {}
    for name, group in zip(names, groups, strict=True):
        shard = dict(next(stream) for _ in group)
        save_file(shard, str(target / name), metadata={"format": "pt"})  # "pt": transformers loads it
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    written = list(names)
    if len(names) > 1:
        total = sum(4 * int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
        (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2))
        written.append(INDEX)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    generation: dict[str, Any] = {"do_sample": False}
    if eos_id is not None:
        generation.update(eos_token_id=eos_id, bos_token_id=eos_id)
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return [*written, "config.json", "generation_config.json"]


# -- reading ----------------------------------------------------------------------------------------------

_DTYPES: Final[dict[str, Callable[[np.ndarray], np.ndarray]]] = {
    "F32": lambda raw: raw.view("<f4"),
    "F16": lambda raw: raw.view("<f2").astype(np.float32),
    "BF16": lambda raw: (raw.view("<u2").astype(np.uint32) << 16).view(np.float32),  # bfloat16: float32's top half
}


class _SafetensorsFile:
    """One safetensors file, memory-mapped: its tensors' dtypes and shapes from the header, each read as
    float32 on demand."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            self.data = np.memmap(path, np.uint8, mode="r", offset=8 + n) if path.stat().st_size > 8 + n \
                else np.zeros(0, np.uint8)
        except (OSError, ValueError) as e:
            raise HFError(f"{path}: not a readable safetensors file: {e}") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        convert = _DTYPES.get(entry["dtype"])
        if convert is None:
            raise HFError(f"{self.path}: {name} is {entry['dtype']}; only F32, F16 and BF16 tensors are read")
        start, end = entry["data_offsets"]
        return convert(np.asarray(self.data[start:end])).reshape(self.shape(name))


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: ``model.safetensors``, or the shards its index names."""
    root = Path(folder)
    if not root.is_dir():
        raise HFError(f"{root}: not a folder (a Hugging Face model folder with {SINGLE} was expected)")
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            return [root / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFError(f"{root / INDEX}: unreadable: {type(e).__name__}: {e}") from None
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
    raise HFError(f"{root}: no {SINGLE} or {INDEX}: only safetensors weights are read"
                  + (f" (found {', '.join(others)}: convert them to safetensors)" if others else ""))


def _open_folder(folder: str | Path) -> dict[str, _SafetensorsFile]:
    """Each tensor name of the folder → the file that holds it."""
    where: dict[str, _SafetensorsFile] = {}
    for path in weight_files(folder):
        if not path.is_file():
            raise HFError(f"{path}: named by {INDEX} but missing")
        f = _SafetensorsFile(path)
        where.update(dict.fromkeys(f.entries, f))
    return where


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _same(where: dict[str, _SafetensorsFile], a: str, b: str) -> bool:
    """Whether the folder's tensors ``a`` and ``b`` both exist and are equal."""
    return a in where and b in where and where[a].shape(a) == where[b].shape(b) \
        and bool(np.array_equal(where[a].read(a), where[b].read(b)))


def read_vector(cfg: ModelConfig, spec: Spec, folder: str | Path, out: np.ndarray) -> None:
    """Fills ``out`` (float32, the spec's size: an array or a writable memory map) with θ from a Hugging Face
    folder, leaf by leaf in the spec's order, after checking every name and shape against the model: HFError,
    one line naming each missing, unexpected and misshapen tensor (and a GPT-2 bias that is not zero)."""
    tensors = mapping(cfg, spec)
    where = _open_folder(folder)
    if cfg.kind == "gpt":  # GPT-2's own checkpoints name the base model's tensors without "transformer."
        where = {(n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}"): f for n, f in where.items()}
    names = {t.name for t in tensors}
    tied = cfg.kind == "gpt" and "lm_head.weight" not in where  # GPT-2's head tied to wte: the head is wte.T
    problems = [f"missing {t.name} {_fmt(t.shape)}" for t in tensors
                if t.name not in where and not (tied and t.name == "lm_head.weight")]
    problems += [f"{t.name} is {_fmt(where[t.name].shape(t.name))}, the config wants {_fmt(t.shape)}"
                 for t in tensors if t.name in where and where[t.name].shape(t.name) != t.shape]
    extra = sorted(n for n in where if n not in names and not _BUFFERS.fullmatch(n))
    if cfg.kind == "llama" and cfg.tie_embeddings and "lm_head.weight" in extra \
            and _same(where, "lm_head.weight", "model.embed_tokens.weight"):
        extra.remove("lm_head.weight")  # a tied model saved with its head written out: the same table
    problems += [f"unexpected {n} {_fmt(where[n].shape(n))}" for n in extra]
    if not problems:
        problems += [f"{t.name} is not all zero (dtrain's GPT has no biases there)" for t in tensors
                     if t.path is None and np.any(where[t.name].read(t.name))]
    if problems:
        raise HFError(f"{folder} does not fit the config's model (model.kind = {cfg.kind}, {len(problems)} "
                      f"difference{'s' if len(problems) > 1 else ''}): {'; '.join(problems)}")
    if out.dtype != np.float32 or out.size != sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in spec):
        raise HFError(f"the output vector must be float32 of the spec's size, got {out.dtype} of {out.size}")
    leaves = _leaves(spec, out.reshape(-1))
    for t in tensors:
        if t.path is None:
            continue
        name = "transformer.wte.weight" if tied and t.name == "lm_head.weight" else t.name
        value = where[name].read(name)
        leaves[t.path][...] = value.T if t.transpose else value


def spec_of(abstract_params: Any) -> Spec:
    """The spec of a model's parameter tree from its shapes alone (``BuiltModel.abstract_params``; imports JAX)."""
    import jax

    from dtrain.codec.spec import flatten

    return flatten(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params))[0]


def load_params(cfg: ModelConfig, abstract_params: Any) -> dict[Any, Any]:
    """``model.init_from``'s folder as the model's parameter tree (host float32 arrays), checked first
    (:func:`read_vector`); for ``dtrain train`` and ``simulate --inprocess``, whose θ_0 is made in-process."""
    from dtrain.codec.spec import unflatten

    spec = spec_of(abstract_params)
    vec = np.empty(sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in spec), np.float32)
    read_vector(cfg, spec, cfg.init_from, vec)
    return unflatten(spec, vec)
