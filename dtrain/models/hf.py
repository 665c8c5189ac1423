"""Hugging Face model folders: dtrain's parameter tree as a ``transformers`` model, and back.

A folder holds ``config.json`` and the weights as float32 (or bfloat16) safetensors: ``model.safetensors``, or
past :data:`SHARD_BYTES` the shards ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``.

- ``model.kind = "llama"`` is ``model.family``'s ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
  or ``MistralForCausalLM`` (their tensors share names): every tensor maps by name, the linear kernels transposed
  (dtrain keeps ``[in, out]``, ``torch.nn.Linear`` ``[out, in]``), biases and q/k norms as they are; RoPE is the
  same rotate-half convention, so q and k need no permutation. A tied head (``model.tie_embeddings``) has no
  ``lm_head.weight``. ``config.json`` is :func:`dtrain.config.hf_fields.config_json`; where θ_0 is read
  (:func:`read_theta0`) the folder's must agree with the config field by field.
- ``model.kind = "gpt"`` is ``GPT2LMHeadModel``, exactly: learned positions (``n_positions = seq_len``),
  LayerNorm with nnx's epsilon (:data:`dtrain.config.hf_fields.GPT_LAYERNORM_EPS`), GELU's tanh approximation
  (``gelu_new``, what ``jax.nn.gelu`` computes by default), an untied head, GPT-2's ``Conv1D`` weights stored
  ``[in, out]`` like dtrain's kernels (no transpose). GPT-2 has biases on its projections where dtrain's GPT has
  none: they are exported as zeros, and a folder whose biases are not all zero is refused.
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
from dtrain.config.hf_fields import HFConfigError, config_json, mismatches, model_fields, read_config_json
from dtrain.config.sections import ModelConfig

__all__ = ["HFError", "SHARD_BYTES", "Tensor", "export_folder", "folder_config", "hf_config", "mapping",
           "read_theta0",
           "read_vector", "weight_files"]

SHARD_BYTES: Final = 5 * 10**9  # transformers' default max_shard_size, "5GB"
SINGLE: Final = "model.safetensors"
INDEX: Final = "model.safetensors.index.json"
EXPORT_DTYPES: Final = ("float32", "bfloat16")  # dtrain export --dtype


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
    (r"blocks/(\d+)/attn/(q|k|v|o)/bias", "model.layers.{0}.self_attn.{1}_proj.bias", False),
    (r"blocks/(\d+)/attn/(q|k)_norm/scale", "model.layers.{0}.self_attn.{1}_norm.weight", False),
    (r"blocks/(\d+)/mlp_norm/scale", "model.layers.{0}.post_attention_layernorm.weight", False),
    (r"blocks/(\d+)/mlp/(gate|up|down)/kernel", "model.layers.{0}.mlp.{1}_proj.weight", True),
    (r"blocks/(\d+)/mlp/(gate|up|down)/bias", "model.layers.{0}.mlp.{1}_proj.bias", False),
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
                      "(LlamaForCausalLM and its families) and gpt (GPT2LMHeadModel) can be exported or imported")
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


def hf_config(cfg: ModelConfig, spec: Spec, eos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for the model (:func:`dtrain.config.hf_fields.config_json`), its weights' ``dtype``."""
    mapping(cfg, spec)  # refuses a kind without a counterpart
    return {**config_json(cfg, eos_id), "torch_dtype": dtype}


def folder_config(folder: str | Path) -> ModelConfig:
    """The model a folder's ``config.json`` describes (every family :func:`dtrain.config.hf_fields.model_fields`
    reads, the one reader of config.json), for looking at a folder (``dtrain.load``); HFError for a missing or
    unreadable config, or a field dtrain does not compute. ``seq_len`` is the folder's context length."""
    path = Path(folder) / "config.json"
    try:
        raw = read_config_json(folder)
        if raw is None:
            raise HFError(f"{folder}: no config.json (a Hugging Face model folder has one)")
        fields = model_fields(raw)
        seq_len = int(raw.get("n_positions", 1024)) if fields["kind"] == "gpt" else int(fields["max_positions"])
        return ModelConfig(**fields, seq_len=seq_len)
    except HFConfigError as e:
        raise HFError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise HFError(f"{path}: unreadable: {type(e).__name__}: {e}") from None


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


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even, as torch's ``.to(bfloat16)``."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def _write_safetensors(path: Path, tensors: list[Tensor], values: Iterator[tuple[str, np.ndarray]],
                       dtype: str) -> None:
    """One safetensors file of ``tensors`` in ``dtype`` (F32 or BF16), written tensor by tensor from ``values``:
    the header first (every shape is known), then each tensor's bytes, so one tensor at a time is in memory."""
    width = 4 if dtype == "F32" else 2
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # "pt": transformers loads it
    offset = 0
    for t in tensors:
        size = width * int(np.prod(t.shape, dtype=np.int64))
        header[t.name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for t in tensors:
            name, value = next(values)
            assert name == t.name  # noqa: S101 - the stream follows the mapping's order
            f.write((value if dtype == "F32" else to_bfloat16(value)).tobytes())


def export_folder(cfg: ModelConfig, spec: Spec, vec: np.ndarray, out: str | Path, shard_bytes: int = SHARD_BYTES,
                  eos_id: int | None = None, dtype: str = "float32") -> list[str]:
    """Writes ``config.json``, ``generation_config.json`` and the safetensors of θ (``vec``, flat float32, in
    ``spec``'s layout) in ``dtype`` (float32, or bfloat16 rounded to nearest even) into ``out`` (created;
    expected empty); shards past ``shard_bytes``, written a tensor at a time. Returns the files written."""
    if dtype not in EXPORT_DTYPES:
        raise HFError(f"--dtype {dtype}: one of {', '.join(EXPORT_DTYPES)}")
    config = hf_config(cfg, spec, eos_id, dtype)  # refuses first, before anything is written
    tensors = mapping(cfg, spec)
    width = 4 if dtype == "float32" else 2
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = width * int(np.prod(t.shape, dtype=np.int64))
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
        _write_safetensors(target / name, group, stream, "F32" if dtype == "float32" else "BF16")
        weight_map.update({t.name: name for t in group})
    written = list(names)
    if len(names) > 1:
        total = sum(width * int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
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


def check_config_json(cfg: ModelConfig, folder: str | Path) -> None:
    """HFError unless the folder's ``config.json`` is there and agrees with ``cfg`` on every field that changes
    the math (:func:`dtrain.config.hf_fields.model_fields`); one line naming each field, the config's value and
    the folder's."""
    try:
        raw = read_config_json(folder)
        if raw is None:
            raise HFError(f"{folder}: no config.json (a Hugging Face model folder has one; dtrain checks the model "
                          "it describes against the config)")
        differ = mismatches(cfg, model_fields(raw))
    except HFConfigError as e:
        raise HFError(f"{Path(folder) / 'config.json'}: {e}") from None
    if differ:
        raise HFError(f"{folder}/config.json describes another model than the config ({len(differ)} "
                      f"difference{'s' if len(differ) > 1 else ''}): {'; '.join(differ)}")


def read_theta0(cfg: ModelConfig, spec: Spec, folder: str | Path, out: np.ndarray) -> None:
    """``model.init_from``'s θ_0 into ``out``: the folder's weights found first (:func:`weight_files`), its
    ``config.json`` checked against the config (:func:`check_config_json`), then :func:`read_vector`."""
    weight_files(folder)
    check_config_json(cfg, folder)
    read_vector(cfg, spec, folder, out)


def spec_of(abstract_params: Any) -> Spec:
    """The spec of a model's parameter tree from its shapes alone (``BuiltModel.abstract_params``; imports JAX)."""
    import jax

    from dtrain.codec.spec import flatten

    return flatten(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params))[0]


def load_params(cfg: ModelConfig, abstract_params: Any) -> dict[Any, Any]:
    """``model.init_from``'s folder as the model's parameter tree (host float32 arrays), checked first
    (:func:`read_theta0`); for ``dtrain train`` and ``simulate --inprocess``, whose θ_0 is made in-process."""
    from dtrain.codec.spec import unflatten

    spec = spec_of(abstract_params)
    vec = np.empty(sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in spec), np.float32)
    read_theta0(cfg, spec, cfg.init_from, vec)
    return unflatten(spec, vec)
