"""A Hugging Face ``config.json`` as dtrain's ``[model]`` fields, and back: what ``model.init_from`` honours.

:func:`model_fields` reads every field of a ``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``
(``model.kind = "llama"``, ``model.family`` its model_type) or ``GPT2Config`` (``model.kind = "gpt"``) that
changes what the model computes, with ``transformers``' class defaults for the ones a file leaves out, and
refuses, naming the field, whatever dtrain does not compute: another model_type, an activation other than SiLU,
a rope type other than linear, dynamic, yarn and llama3 (or yarn with its own betas or attention factor), partial
rotary embeddings, Qwen's per-layer sliding windows, dropout. Both spellings of the rope are read:
``rope_theta`` with ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).

:func:`reconcile` is the comparison: the config's effective value of each field (``n_kv_heads = 0`` is
``n_heads``, ``head_dim = 0`` is ``d_model / n_heads``, ...) against the folder's; a field the config leaves
unset is taken from the folder, one it sets otherwise is refused in one line that names the field, the config's
value and the folder's. :func:`config_json` writes the file back from the fields (``dtrain export``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any, Final

from dtrain.config.sections import ModelConfig

ARCHITECTURES: Final = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "mistral": "MistralForCausalLM"}
GPT_LAYERNORM_EPS: Final = 1e-6  # flax.nnx.LayerNorm's default epsilon, which dtrain's GPT uses
# transformers' class defaults of the fields a config.json may leave out (configuration_<family>.py)
_DEFAULTS: Final[dict[str, dict[str, Any]]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
}
_ROPE_KEYS: Final = {"default": set(), "linear": {"factor"}, "dynamic": {"factor"},
                     "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                              "attention_factor", "mscale", "mscale_all_dim", "truncate"},
                     "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}}
# the [model] fields a llama folder sets, and the gpt2 folder's
LLAMA_FIELDS: Final = ("kind", "family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden",
                       "head_dim", "norm_eps", "rope_theta", "tie_embeddings", "attention_bias", "mlp_bias",
                       "sliding_window", "max_positions", "rope_scaling", "rope_factor", "rope_original_max",
                       "rope_low_freq_factor", "rope_high_freq_factor")
GPT_FIELDS: Final = ("kind", "vocab_size", "d_model", "n_layers", "n_heads", "mlp_ratio")


class HFConfigError(ValueError):
    """A config.json dtrain cannot honour, or one the config contradicts; the message is one line."""


def read_config_json(folder: str | Path) -> dict[str, Any] | None:
    """The folder's config.json as a dict, None if there is none; HFConfigError if it is unreadable."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFConfigError(f"{path}: unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"{path}: not a JSON object")
    return raw


def _refuse(key: str, value: Any, why: str) -> HFConfigError:
    return HFConfigError(f"config.json has {key} = {json.dumps(value)}: {why}")


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` fields of a Hugging Face config (effective values: no 0-means-default), or HFConfigError
    naming the first field dtrain does not compute."""
    model_type = hf.get("model_type")
    if model_type == "gpt2":
        return _gpt2_fields(hf)
    if model_type not in ARCHITECTURES:
        raise _refuse("model_type", model_type, "dtrain has llama, qwen2, qwen3 and mistral (model.kind = llama) "
                      "and gpt2 (model.kind = gpt)")
    d = {**_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None}}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(d.get(key), int):
            raise _refuse(key, d.get(key), "an integer is needed")
    if d.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", d["hidden_act"], "dtrain's SwiGLU computes silu only")
    if d.get("attention_dropout", 0.0) != 0.0:
        raise _refuse("attention_dropout", d["attention_dropout"], "dtrain has no dropout")
    if d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or ()):
        key = "use_sliding_window" if d.get("use_sliding_window") else "layer_types"
        raise _refuse(key, d[key], "per-layer attention types (sliding windows past max_window_layers) are not "
                      "supported: every layer attends fully (Mistral's sliding_window is)")
    heads = d["num_attention_heads"]
    out: dict[str, Any] = {
        "kind": "llama", "family": model_type, "vocab_size": d["vocab_size"], "d_model": d["hidden_size"],
        "n_layers": d["num_hidden_layers"], "n_heads": heads, "n_kv_heads": d.get("num_key_value_heads", heads),
        "mlp_hidden": d["intermediate_size"], "head_dim": d.get("head_dim", d["hidden_size"] // heads),
        "norm_eps": float(d["rms_norm_eps"]), "tie_embeddings": bool(d.get("tie_word_embeddings", False)),
        "attention_bias": bool(d.get("attention_bias", False)) if model_type in ("llama", "qwen3") else False,
        "mlp_bias": bool(d.get("mlp_bias", False)) if model_type == "llama" else False,
        "sliding_window": int(d.get("sliding_window") or 0) if model_type == "mistral" else 0,
        "max_positions": int(d["max_position_embeddings"]),
    }
    return out | _rope_fields(d)


def _rope_fields(d: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the rope_* fields from either spelling of the rope."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise _refuse("rope_parameters", params, "one rope for every layer is needed")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise _refuse("rope_scaling.rope_type", kind, "dtrain computes default, linear, dynamic, yarn and llama3")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse("partial_rotary_factor", partial, "dtrain rotates the whole head")
    unknown = sorted(set(params) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if unknown:
        raise _refuse(f"rope_scaling.{unknown[0]}", params[unknown[0]], f"not read for rope_type {kind!r}")
    positions = int(d["max_position_embeddings"])
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
                           "rope_scaling": "none" if kind == "default" else kind, "rope_factor": 1.0,
                           "rope_original_max": 0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0}
    if kind == "default":
        return out
    original = int(params.get("original_max_position_embeddings") or positions)
    factor = params.get("factor")
    if kind == "yarn":
        for key, default in (("beta_fast", 32), ("beta_slow", 1), ("truncate", True)):
            if params.get(key) not in (None, default):
                raise _refuse(f"rope_scaling.{key}", params[key], f"dtrain's yarn takes the default {default}")
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key):
                raise _refuse(f"rope_scaling.{key}", params[key], "dtrain's yarn scales attention by the default "
                              "0.1 * ln(factor) + 1")
        factor = positions / original if factor is None else factor
    if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise _refuse("rope_scaling.factor", factor, "a number > 0 is needed")
    out.update(rope_factor=float(factor))
    if kind in ("yarn", "llama3"):
        out.update(rope_original_max=original)
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]))
    return out


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    d = {k: v for k, v in hf.items() if v is not None}
    if d.get("activation_function", "gelu_new") != "gelu_new":
        raise _refuse("activation_function", d["activation_function"], "dtrain's GPT computes gelu_new only")
    if float(d.get("layer_norm_epsilon", 1e-5)) != GPT_LAYERNORM_EPS:
        raise _refuse("layer_norm_epsilon", d.get("layer_norm_epsilon", 1e-5),
                      f"dtrain's GPT normalizes with {GPT_LAYERNORM_EPS}")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if d.get(key):
            raise _refuse(key, d[key], "dtrain's GPT does not")
    width = d.get("n_embd", 768)
    inner = d.get("n_inner") or 4 * width
    if inner % width:
        raise _refuse("n_inner", inner, f"dtrain's GPT needs a multiple of n_embd ({width})")
    return {"kind": "gpt", "vocab_size": d.get("vocab_size", 50257), "d_model": width, "n_layers": d.get("n_layer", 12),
            "n_heads": d.get("n_head", 12), "mlp_ratio": inner // width}


def effective(cfg: ModelConfig, name: str) -> Any:
    """The value a field means for the model (0-means-default resolved), as :func:`model_fields` gives it."""
    resolved = {"n_kv_heads": cfg.kv_heads, "mlp_hidden": cfg.swiglu_hidden, "head_dim": cfg.head_size,
                "max_positions": cfg.positions}
    if cfg.rope_scaling in ("yarn", "llama3"):  # the scalings that read it: 0 there is max_positions
        resolved["rope_original_max"] = cfg.rope_original_max or cfg.positions
    return resolved.get(name, getattr(cfg, name))


def reconcile(cfg: ModelConfig, folder_fields: dict[str, Any], explicit: Collection[str], folder: str) -> ModelConfig:
    """``cfg`` with each field the folder sets and the config does not (not in ``explicit``) taken from the folder;
    HFConfigError, one line, for the first field the config sets to another value. A field whose effective
    value already agrees keeps the config's spelling (``n_kv_heads = 0`` stays 0)."""
    for name, theirs in folder_fields.items():  # in order: max_positions is settled before what reads it
        ours = effective(cfg, name)
        if _equal(ours, theirs):
            continue
        if name in explicit:
            raise HFConfigError(f"model.{name}: the config has {_shown(cfg, name)}, {folder}/config.json has "
                                f"{theirs!r}: drop the setting (the folder's is taken) or point model.init_from "
                                f"at another folder")
        cfg = dataclasses.replace(cfg, **{name: theirs})
    return cfg


def mismatches(cfg: ModelConfig, folder_fields: dict[str, Any]) -> list[str]:
    """Each field whose effective value differs from the folder's, as ``model.NAME is ours, config.json has
    theirs``."""
    return [f"model.{name} is {_shown(cfg, name)}, config.json has {theirs!r}"
            for name, theirs in folder_fields.items() if not _equal(effective(cfg, name), theirs)]


def _shown(cfg: ModelConfig, name: str) -> str:
    """The config's value of a field, and what it means where that differs (``0 (= 4)``)."""
    raw, meant = getattr(cfg, name), effective(cfg, name)
    return repr(raw) if raw == meant else f"{raw!r} (= {meant!r})"


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return bool(a == b)


# -- writing ----------------------------------------------------------------------------------------------


def config_json(cfg: ModelConfig, eos_id: int | None = None) -> dict[str, Any]:
    """``config.json`` of the model: its family's ``*ForCausalLM`` or ``GPT2LMHeadModel``."""
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
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family, **common,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.swiglu_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.positions, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_json(cfg), "hidden_act": "silu", "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings}
    if cfg.family in ("llama", "qwen3"):
        out["attention_bias"] = cfg.attention_bias
    if cfg.family == "llama":
        out.update(mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    if cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window or None
    if cfg.family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    return out


def _rope_json(cfg: ModelConfig) -> dict[str, Any] | None:
    if cfg.rope_scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling in ("yarn", "llama3"):
        out["original_max_position_embeddings"] = cfg.rope_original_max or cfg.positions
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    return out
