"""Cross-field validation of a loaded config: one validator per section (or group), run in a fixed order; the
first failure raises a ConfigError that names the origin, the section and the field."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import NoReturn

from dtrain.codec import MAX_CHUNK
from dtrain.config.derived import parse_binding
from dtrain.config.sections import (
    FAMILY_MODEL_FIELDS,
    LLAMA_ONLY_MODEL_FIELDS,
    MAX_FRAGMENTS,
    MAX_VOCAB_SIZE,
    MIX_PERIOD,
    ROUND_AUTO,
    SECTIONS,
    SOURCE_NAME_RE,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
)

_OTLP_ENDPOINT = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}/?")
_Fail = Callable[[str, str, str], NoReturn]  # fail(section, field, why): raises the ConfigError naming the field

# Fields that must be >= 1 and >= 0, checked in this order (their message gives the value).
_AT_LEAST_ONE = [("run", "log_every"), ("run", "keep_checkpoints"), ("model", "vocab_size"), ("model", "seq_len"),
                 ("model", "d_model"), ("model", "n_layers"), ("model", "n_heads"), ("model", "mlp_ratio"),
                 ("data", "eval_batches"), ("train", "batch_size"), ("train", "steps"), ("train", "steps_per_call"),
                 ("outer", "islands"), ("outer", "inner_steps")]
_AT_LEAST_ZERO = [("run", "eval_every"), ("run", "checkpoint_every"), ("data", "max_bytes"),
                  ("train", "warmup_steps"), ("train", "weight_decay"), ("train", "muon_weight_decay"),
                  ("train", "grad_clip"), ("outer", "staleness_alpha"), ("model", "loss_chunk"),
                  ("coordinator", "merge_threads")]


def _check_choices(cfg: Config, fail: _Fail) -> None:
    """Every field with ``choices`` in its metadata holds one of them."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                fail(section, f.name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_signs(cfg: Config, fail: _Fail) -> None:
    """The counts of :data:`_AT_LEAST_ONE` are >= 1, then those of :data:`_AT_LEAST_ZERO` >= 0."""
    for section, name in _AT_LEAST_ONE:
        if getattr(getattr(cfg, section), name) < 1:
            fail(section, name, f"must be >= 1, got {getattr(getattr(cfg, section), name)}")
    for section, name in _AT_LEAST_ZERO:
        if getattr(getattr(cfg, section), name) < 0:
            fail(section, name, f"must be >= 0, got {getattr(getattr(cfg, section), name)}")


def _check_model(cfg: Config, fail: _Fail) -> None:
    """[model]: heads divide the width, cuDNN attention's dtype and head size, the vocabulary fits int32 ids, then
    :func:`_check_llama`."""
    m = cfg.model
    if m.d_model % m.n_heads:
        fail("model", "n_heads", f"must divide d_model ({m.d_model} % {m.n_heads} = {m.d_model % m.n_heads})")
    if m.attention == "cudnn" and m.kind in ("gpt", "llama"):
        if m.dtype != "bfloat16":
            fail("model", "attention", f"cudnn (fused flash attention) needs model.dtype = \"bfloat16\", "
                 f"got {m.dtype!r}")
        if m.head_size % 8:
            fail("model", "attention", f"cudnn needs a head size (model.head_dim, or d_model / n_heads) that is a "
                 f"multiple of 8, got {m.head_size}")
    if m.vocab_size > MAX_VOCAB_SIZE:
        fail("model", "vocab_size", f"token ids are int32, so at most {MAX_VOCAB_SIZE}, got {m.vocab_size}")
    if m.init_from and m.kind not in ("llama", "gpt"):
        fail("model", "init_from", f"a Hugging Face folder holds a llama or a gpt, not a {m.kind}")
    _check_llama(cfg, fail)


def _check_llama(cfg: Config, fail: _Fail) -> None:
    """[model]'s llama-only fields: left at their defaults by the other kinds; for the llama, kv heads dividing the
    heads, an even head size (RoPE rotates halves), a positive rope base and norm epsilon, a hidden width >= 0."""
    m, defaults = cfg.model, ModelConfig()
    if m.kind != "llama":
        for name in LLAMA_ONLY_MODEL_FIELDS + FAMILY_MODEL_FIELDS:
            if getattr(m, name) != getattr(defaults, name):
                fail("model", name, f"only model.kind = \"llama\" has it; {m.kind} needs the default "
                     f"{getattr(defaults, name)!r}, got {getattr(m, name)!r}")
        return
    if m.n_kv_heads < 0 or (m.n_kv_heads and m.n_heads % m.n_kv_heads):
        fail("model", "n_kv_heads", f"must divide n_heads ({m.n_heads}) or be 0 (= n_heads), got {m.n_kv_heads}")
    for name in ("rope_theta", "norm_eps"):
        if not (math.isfinite(getattr(m, name)) and getattr(m, name) > 0):
            fail("model", name, f"must be a finite number > 0, got {getattr(m, name)}")
    if m.mlp_hidden < 0:
        fail("model", "mlp_hidden", f"must be >= 0 (0: Llama's rule), got {m.mlp_hidden}")
    _check_family(m, fail)


# the switches each family has (Hugging Face's config fields); the rest stay at their defaults
_FAMILY_SWITCHES = {"llama": ("attention_bias", "mlp_bias"), "qwen2": (), "qwen3": ("attention_bias",),
                    "mistral": ("sliding_window",)}
_ROPE_FIELDS = {"none": (), "linear": ("rope_factor",), "dynamic": ("rope_factor",),
                "yarn": ("rope_factor", "rope_original_max"),
                "llama3": ("rope_factor", "rope_original_max", "rope_low_freq_factor", "rope_high_freq_factor")}


def _check_family(m: ModelConfig, fail: _Fail) -> None:
    """The llama's family switches: only the family's own off their defaults; an even head size, rope scaling's
    numbers in range and only those of its type set."""
    defaults = ModelConfig()
    for name in ("attention_bias", "mlp_bias", "sliding_window"):
        if getattr(m, name) != getattr(defaults, name) and name not in _FAMILY_SWITCHES[m.family]:
            fail("model", name, f"model.family = {m.family!r} has no such switch (only "
                 f"{', '.join(f for f, s in _FAMILY_SWITCHES.items() if name in s)}); leave it at "
                 f"{getattr(defaults, name)!r}")
    for name in ("head_dim", "sliding_window", "max_positions", "rope_original_max"):
        if getattr(m, name) < 0:
            fail("model", name, f"must be >= 0 (0: the default), got {getattr(m, name)}")
    if m.head_size % 2:
        fail("model", "head_dim" if m.head_dim else "n_heads", f"the head size (model.head_dim, or d_model / "
             f"n_heads) must be even for rotary embeddings, got {m.head_size}")
    for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        if not (math.isfinite(getattr(m, name)) and getattr(m, name) > 0):
            fail("model", name, f"must be a finite number > 0, got {getattr(m, name)}")
    for name in ("rope_factor", "rope_original_max", "rope_low_freq_factor", "rope_high_freq_factor"):
        if getattr(m, name) != getattr(defaults, name) and name not in _ROPE_FIELDS[m.rope_scaling]:
            fail("model", name, f"model.rope_scaling = {m.rope_scaling!r} does not read it; leave it at "
                 f"{getattr(defaults, name)!r}")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        fail("model", "rope_high_freq_factor", f"must be > rope_low_freq_factor ({m.rope_low_freq_factor}), got "
             f"{m.rope_high_freq_factor}")


def _check_sources(d: DataConfig, fail: _Fail) -> None:
    """data.sources: a mixture of stores, exclusive with data.source; each a path, a positive weight that is at
    least 1/MIX_PERIOD of the total (the schedule's resolution), a unique name. That each is a store, and that
    they share one tokenizer, is checked where they are opened (dtrain.data.mixture)."""
    if not d.sources:
        return
    if d.source != DataConfig.source:
        fail("data", "sources", f"given with data.source = {d.source!r}: name the stores in one or the other (a "
             "mixture is data.sources alone)")
    total = sum(s.weight for s in d.sources if math.isfinite(s.weight) and s.weight > 0)
    seen: set[str] = set()
    for i, src in enumerate(d.sources):
        where = f"sources[{i}]"
        if not src.path.strip():
            fail("data", f"{where}.path", "is empty: name a token store")
        if not (math.isfinite(src.weight) and src.weight > 0):
            fail("data", f"{where}.weight", f"must be a number > 0, got {src.weight}")
        if src.weight / total < 1 / MIX_PERIOD:
            fail("data", f"{where}.weight", f"{src.weight:g} is {src.weight / total:.2g} of the total {total:g}: a "
                 f"source needs at least 1/{MIX_PERIOD} of it")
        if not SOURCE_NAME_RE.fullmatch(src.label):
            fail("data", f"{where}.name", f"{src.label!r}: a source's name is 1 to 64 of [A-Za-z0-9._-] (set name)")
        if src.label in seen:
            fail("data", f"{where}.name", f"{src.label!r} names two sources: give each its own name")
        seen.add(src.label)


def _check_optimization(cfg: Config, fail: _Fail) -> None:
    """[data]'s eval split, then the inner ([train]) and outer ([outer]) optimizers' ranges."""
    t, o, d = cfg.train, cfg.outer, cfg.data
    if not 0.0 < d.eval_fraction < 0.5:
        fail("data", "eval_fraction", f"must be in (0, 0.5), got {d.eval_fraction}")
    if not (d.tokenizer == "bytes" or (d.tokenizer.startswith("bpe:") and d.tokenizer[4:].isdigit()
                                       and int(d.tokenizer[4:]) >= 257) or d.tokenizer.endswith(".json")):
        fail("data", "tokenizer", f"must be 'bytes', 'bpe:N' (N >= 257) or a tokenizer.json path, got "
             f"{d.tokenizer!r}")
    if not d.read_timeout_s > 0:
        fail("data", "read_timeout_s", f"must be > 0, got {d.read_timeout_s}")
    _check_sources(d, fail)
    if not t.lr > 0:
        fail("train", "lr", f"must be > 0, got {t.lr}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        fail("train", "min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    if not t.muon_lr > 0:
        fail("train", "muon_lr", f"must be > 0, got {t.muon_lr}")
    for name in ("b1", "b2", "muon_beta"):
        if not 0.0 <= getattr(t, name) < 1.0:
            fail("train", name, f"must be in [0, 1), got {getattr(t, name)}")
    if t.warmup_steps >= t.steps:
        fail("train", "warmup_steps", f"must be < train.steps ({t.steps}), got {t.warmup_steps}")
    if o.inner_steps > t.steps:  # H > steps would be one round shorter than H: the run's length is train.steps
        fail("outer", "inner_steps", f"must be <= train.steps ({t.steps}), got {o.inner_steps}")
    if not o.lr > 0:
        fail("outer", "lr", f"must be > 0, got {o.lr}")
    if not 0.0 <= o.momentum < 1.0:
        fail("outer", "momentum", f"must be in [0, 1), got {o.momentum}")
    if not o.sparseloco_lr > 0:
        fail("outer", "sparseloco_lr", f"must be > 0, got {o.sparseloco_lr}")
    if not 0.0 < o.sparseloco_beta <= 1.0:
        fail("outer", "sparseloco_beta", f"must be in (0, 1], got {o.sparseloco_beta}")
    if not o.mask_lr > 0:
        fail("outer", "mask_lr", f"must be > 0, got {o.mask_lr}")
    if not 0.0 < o.mask_beta <= 1.0:
        fail("outer", "mask_beta", f"must be in (0, 1], got {o.mask_beta}")
    _check_fragments(cfg, fail)
    _check_shards(cfg, fail)


def _check_shards(cfg: Config, fail: _Fail) -> None:
    """coordinator.shards: 1..64; more than one only with what a sharded coordinator does (sync rounds, no
    fragments, no direction screen) and a shard secret."""
    co = cfg.coordinator
    if not 1 <= co.shards <= MAX_FRAGMENTS:
        fail("coordinator", "shards", f"must be in 1..{MAX_FRAGMENTS}, got {co.shards}")
    if co.shards == 1:
        return
    if cfg.outer.fragments != 1:
        fail("coordinator", "shards", f"{co.shards} shards with outer.fragments = {cfg.outer.fragments}: a sharded "
             f"coordinator does not exchange fragments yet; set one of them to 1")
    if co.mode != "sync":
        fail("coordinator", "shards", f"needs coordinator.mode = 'sync' (every shard commits each version "
             f"together), got {co.mode!r}")
    if co.merge_rule == "screened_mean":
        fail("coordinator", "merge_rule", "screened_mean with coordinator.shards > 1: the direction screen is not "
             "built for a sharded coordinator yet; use clipped_mean (what auto takes there), mean, trimmed_mean or "
             "median")
    if not co.shard_secret_file:
        fail("coordinator", "shard_secret_file", f"coordinator.shards = {co.shards} needs a file holding the "
             f"secret the lead presents to the other shards")
    if co.shard_addresses and len(co.shard_addresses) != co.shards - 1:
        fail("coordinator", "shard_addresses", f"{len(co.shard_addresses)} addresses for {co.shards} shards: give "
             f"shards 1..{co.shards - 1}'s, {co.shards - 1} of them")


def _check_fragments(cfg: Config, fail: _Fail) -> None:
    """outer.fragments: 1..64, dividing outer.inner_steps, with step rounds of a synchronous coordinator (the
    round robin of fragments follows the versions: one merge per round)."""
    o = cfg.outer
    if o.fragments == 1:
        return
    if not 1 <= o.fragments <= MAX_FRAGMENTS:
        fail("outer", "fragments", f"must be in 1..{MAX_FRAGMENTS}, got {o.fragments}")
    if o.inner_steps % o.fragments:
        fail("outer", "fragments", f"must divide outer.inner_steps ({o.inner_steps}), got {o.fragments}")
    if cfg.coordinator.mode != "sync":
        fail("outer", "fragments", f"needs coordinator.mode = 'sync' (fragments merge in turn, one per round), "
             f"got {cfg.coordinator.mode!r}")
    if cfg.worker.round_seconds != 0:
        fail("outer", "fragments", "needs step rounds (worker.round_seconds = 0)")


def _check_mesh_and_codec(cfg: Config, fail: _Fail) -> None:
    """[mesh]'s axis sizes, then [codec]'s block, zstd level and chunk size."""
    mesh = cfg.mesh
    if mesh.data == 0 or mesh.data < -1:
        fail("mesh", "data", f"must be >= 1 or -1 (all devices), got {mesh.data}")
    if mesh.fsdp < 1:
        fail("mesh", "fsdp", f"must be >= 1, got {mesh.fsdp}")
    c = cfg.codec
    if c.block % 2 or not 64 <= c.block <= 65536:
        fail("codec", "block", f"must be even and in [64, 65536], got {c.block}")
    if "int2" in (c.up, c.down) and c.block % 4:
        fail("codec", "block", f"must be a multiple of 4 with the int2 codec (each block starts a byte), got "
             f"{c.block}")
    if not 1 <= c.zstd_level <= 19:
        fail("codec", "zstd_level", f"must be in [1, 19], got {c.zstd_level}")
    if not -7 <= c.up_zstd_level <= 19:
        fail("codec", "up_zstd_level", f"must be in [-7, 19] (0: by codec.up), got {c.up_zstd_level}")
    if not 4096 <= c.chunk_bytes <= 4 << 20:
        fail("codec", "chunk_bytes", f"must be in [4096, 4194304], got {c.chunk_bytes}")
    if c.sparse_chunk % 2 or not 64 <= c.sparse_chunk <= MAX_CHUNK:
        fail("codec", "sparse_chunk", f"must be even and in [64, {MAX_CHUNK}], got {c.sparse_chunk}")
    if not 0.0 < c.density <= 1.0:
        fail("codec", "density", f"must be in (0, 1], got {c.density}")
    if not 0.0 < c.mask_density <= 1.0:
        fail("codec", "mask_density", f"must be in (0, 1], got {c.mask_density}")
    if not 0.0 <= c.down_density <= 1.0:
        fail("codec", "down_density", f"must be in [0, 1] (0: the union of the pushes), got {c.down_density}")


def _check_coordinator(cfg: Config, fail: _Fail) -> None:
    """[coordinator]: ports, rounds, leases, message and stream sizes (message size against codec.chunk_bytes)."""
    co, c = cfg.coordinator, cfg.codec
    if c.up == "sparse" and co.merge_rule in ("median", "trimmed_mean", "screened_mean"):
        fail("coordinator", "merge_rule", f"{co.merge_rule} takes a per-coordinate median or trim, and sparse "
             f"pushes (codec.up = sparse) rarely hold the same entries: it would drop most of them; use "
             f"clipped_mean (or auto)")
    if not 0 <= co.port <= 65535:
        fail("coordinator", "port", f"must be in [0, 65535], got {co.port}")
    if not -1 <= co.dashboard_port <= 65535:
        fail("coordinator", "dashboard_port", f"must be -1 (no dashboard) or in [0, 65535], got {co.dashboard_port}")
    if co.dashboard_port == co.port != 0:
        fail("coordinator", "dashboard_port", f"must differ from coordinator.port ({co.port})")
    if co.dashboard_host != co.dashboard_host.strip() or any(c in co.dashboard_host for c in "/ \t"):
        fail("coordinator", "dashboard_host", f"must be a host name or address (empty: coordinator.host), got "
             f"{co.dashboard_host!r}")
    if co.min_quorum < 0:
        fail("coordinator", "min_quorum", f"must be >= 0, got {co.min_quorum}")
    for name in ("grace_s", "lease_s"):
        if not getattr(co, name) > 0:
            fail("coordinator", name, f"must be > 0, got {getattr(co, name)}")
    if co.max_staleness < 0:
        fail("coordinator", "max_staleness", f"must be >= 0, got {co.max_staleness}")
    if co.keep_updates < 1:
        fail("coordinator", "keep_updates", f"must be >= 1, got {co.keep_updates}")
    if co.max_message_bytes < c.chunk_bytes + 4096:
        fail("coordinator", "max_message_bytes", f"must exceed codec.chunk_bytes ({c.chunk_bytes}) by 4 KiB, "
             f"got {co.max_message_bytes}")
    if co.workers == 1 or co.workers < 0:
        fail("coordinator", "workers", f"must be 0 (auto) or >= 2, got {co.workers}")
    if not (math.isfinite(co.stream_idle_s) and co.stream_idle_s > 0):
        fail("coordinator", "stream_idle_s", f"must be a finite number > 0, got {co.stream_idle_s}")
    if co.max_streams_per_peer < 0:
        fail("coordinator", "max_streams_per_peer", f"must be 0 (auto) or >= 1, got {co.max_streams_per_peer}")
    if co.max_streams_per_island < 1:
        fail("coordinator", "max_streams_per_island", f"must be >= 1, got {co.max_streams_per_island}")
    for name in ("stream_min_bytes_per_s", "stream_rate_grace_s"):
        if not (math.isfinite(getattr(co, name)) and getattr(co, name) >= 0):
            fail("coordinator", name, f"must be a finite number >= 0, got {getattr(co, name)}")
    if not (math.isfinite(co.stream_deadline_s) and co.stream_deadline_s > 0):
        fail("coordinator", "stream_deadline_s", f"must be a finite number > 0, got {co.stream_deadline_s}")
    if co.max_pulls_per_peer < 0:
        fail("coordinator", "max_pulls_per_peer", f"must be 0 (auto) or >= 1, got {co.max_pulls_per_peer}")
    if co.max_pulls_per_island < 1:
        fail("coordinator", "max_pulls_per_island", f"must be >= 1, got {co.max_pulls_per_island}")
    if co.refusal_events < 1:
        fail("coordinator", "refusal_events", f"must be >= 1, got {co.refusal_events}")
    if not (math.isfinite(co.forget_after_s) and co.forget_after_s >= 0):
        fail("coordinator", "forget_after_s", f"must be a finite number >= 0 (0: never), got {co.forget_after_s}")
    if co.pull_cache_bytes < 0:
        fail("coordinator", "pull_cache_bytes", f"must be >= 0, got {co.pull_cache_bytes}")
    if co.stream_budget_bytes < 0:
        fail("coordinator", "stream_budget_bytes", f"must be >= 0, got {co.stream_budget_bytes}")
    if co.stream_window_bytes and not 64 << 10 <= co.stream_window_bytes <= 1 << 30:
        fail("coordinator", "stream_window_bytes", f"must be 0 or in [65536, 1073741824], got {co.stream_window_bytes}")


def _check_merge(cfg: Config, fail: _Fail) -> None:
    """[coordinator]'s merge knobs: push caps, trimming, eval cadence and the norm outlier checks."""
    co = cfg.coordinator
    for name in ("max_push_steps", "trim", "eval_every", "max_receiving", "max_rejections"):
        if getattr(co, name) < 0:
            fail("coordinator", name, f"must be >= 0, got {getattr(co, name)}")
    for name in ("norm_z_max", "norm_max_ratio", "clip_norm", "reject_backoff_s"):
        if not (math.isfinite(getattr(co, name)) and getattr(co, name) >= 0):
            fail("coordinator", name, f"must be a finite number >= 0, got {getattr(co, name)}")
    if not (math.isfinite(co.clip_ratio) and co.clip_ratio > 0):
        fail("coordinator", "clip_ratio", f"must be a finite number > 0, got {co.clip_ratio}")
    for name in ("min_cosine", "probation_min_cosine"):
        value = getattr(co, name)
        if not (math.isfinite(value) and -1 <= value < 1):
            fail("coordinator", name, f"must be a finite number in [-1, 1), got {value}")
    if not (math.isfinite(co.round_norm_ratio) and (co.round_norm_ratio == 0 or co.round_norm_ratio > 1)):
        fail("coordinator", "round_norm_ratio", f"must be 0 (off) or a finite number > 1, got {co.round_norm_ratio}")
    if co.norm_window < 1:
        fail("coordinator", "norm_window", f"must be >= 1, got {co.norm_window}")
    if not 1 <= co.norm_window_min <= co.norm_window:
        fail("coordinator", "norm_window_min", f"must be in [1, norm_window={co.norm_window}], "
             f"got {co.norm_window_min}")


def _check_worker(cfg: Config, fail: _Fail) -> None:
    """[worker]: overlap and round lengths, timeouts, and heartbeats at most half of coordinator.lease_s."""
    w, co = cfg.worker, cfg.coordinator
    if w.max_overlap_steps < 0:
        fail("worker", "max_overlap_steps", f"must be >= 0, got {w.max_overlap_steps}")
    if w.round_seconds < 0 and w.round_seconds != ROUND_AUTO:
        fail("worker", "round_seconds", f"must be >= 0 or 'auto', got {w.round_seconds}")
    if w.start_wait_s < 0:
        fail("worker", "start_wait_s", f"must be >= 0, got {w.start_wait_s}")
    for name in ("heartbeat_s", "rpc_deadline_s", "retry_initial_s", "retry_max_s", "retry_total_s"):
        if not getattr(w, name) > 0:
            fail("worker", name, f"must be > 0, got {getattr(w, name)}")
    if w.heartbeat_s > co.lease_s / 2:  # two heartbeats per lease at least: one lost heartbeat loses no island
        fail("worker", "heartbeat_s", f"must be at most half of coordinator.lease_s ({co.lease_s}), "
             f"got {w.heartbeat_s}")


def _check_health(cfg: Config, fail: _Fail) -> None:
    """[health]: probe periods, the outlier threshold and the fewest devices."""
    h = cfg.health
    for name in ("known_answer_every", "replay_every"):
        if getattr(h, name) < 0:
            fail("health", name, f"must be >= 0 (0: off), got {getattr(h, name)}")
    if not (math.isfinite(h.z_max) and h.z_max > 0):
        fail("health", "z_max", f"must be a finite number > 0, got {h.z_max}")
    if h.min_devices < 1:
        fail("health", "min_devices", f"must be >= 1, got {h.min_devices}")


def _check_security(cfg: Config, fail: _Fail) -> None:
    """[security]: certificates come with their keys; mutual TLS has a CA and a server certificate."""
    sec = cfg.security
    if bool(sec.server_cert) != bool(sec.server_key):
        fail("security", "server_key" if sec.server_cert else "server_cert",
             "server_cert and server_key go together")
    if bool(sec.client_cert) != bool(sec.client_key):
        fail("security", "client_key" if sec.client_cert else "client_cert",
             "client_cert and client_key go together")
    if sec.client_auth and not (sec.ca and sec.server_cert):
        fail("security", "client_auth", "mutual TLS needs security.ca and security.server_cert")
    if sec.identity == "token" and not sec.island_tokens:
        fail("security", "island_tokens", "identity 'token' needs the file of the islands' token hashes (`dtrain "
             "admin issue-token NAME` prints a line of it)")
    if sec.identity == "cert" and not sec.client_auth:
        fail("security", "identity", "'cert' reads the islands' client certificates: set security.client_auth "
             "(mutual TLS)")
    if sec.bindings and sec.identity == "shared":
        fail("security", "bindings", "pins bind names to identities: set security.identity to 'token' or 'cert'")
    for i, text in enumerate(sec.bindings):
        try:
            parse_binding(text)
        except ValueError as e:
            fail("security", f"bindings[{i}]", str(e))


def _check_telemetry(cfg: Config, fail: _Fail) -> None:
    """[telemetry]: export timings, the OTLP endpoint's form (with the otlp exporter), a service name."""
    tel = cfg.telemetry
    for name in ("otlp_timeout_s", "export_interval_s"):
        if not (math.isfinite(getattr(tel, name)) and getattr(tel, name) > 0):
            fail("telemetry", name, f"must be a finite number > 0, got {getattr(tel, name)}")
    if tel.exporter == "otlp" and not _OTLP_ENDPOINT.fullmatch(tel.otlp_endpoint):
        fail("telemetry", "otlp_endpoint", f"must be http://HOST:PORT or https://HOST:PORT, got "
             f"{tel.otlp_endpoint!r}")
    if not tel.service_name.strip():
        fail("telemetry", "service_name", "must not be empty")


def _check_batch_split(cfg: Config, fail: _Fail) -> None:
    """train.batch_size splits evenly over the mesh's fixed devices (mesh.data x mesh.fsdp; data -1 counts 1)."""
    mesh, t = cfg.mesh, cfg.train
    fixed = (mesh.data if mesh.data > 0 else 1) * mesh.fsdp
    if t.batch_size % fixed:
        fail("train", "batch_size", f"{t.batch_size} is not divisible by the mesh's {fixed} devices "
             f"(mesh.data x mesh.fsdp)")
    if t.base_batch_size < 0:
        fail("train", "base_batch_size", f"must be >= 0, got {t.base_batch_size}")
    if t.shard_sequences % t.batch_size:
        fail("train", "batch_size", f"{t.batch_size} does not divide a shard of train.steps x base_batch_size = "
             f"{t.steps} x {t.base_batch} = {t.shard_sequences} sequences")


# The validators in the order they run: the first failure is the one reported.
_VALIDATORS: tuple[Callable[[Config, _Fail], None], ...] = (
    _check_choices, _check_signs, _check_model, _check_optimization, _check_mesh_and_codec, _check_coordinator,
    _check_merge, _check_worker, _check_health, _check_security, _check_telemetry, _check_batch_split)


def check(cfg: Config, origin: str) -> None:
    """Cross-field validation, one validator per section (or group) in :data:`_VALIDATORS`' order; the first
    failure raises a ConfigError that names the origin, the section and the field."""

    def fail(section: str, name: str, why: str) -> NoReturn:
        raise ConfigError(f"{origin}: [{section}] {name}: {why}")

    for validate in _VALIDATORS:
        validate(cfg, fail)
