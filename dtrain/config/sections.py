"""The configuration's sections: frozen dataclasses, one per TOML section, and the rules read off them.

Every field carries its comment in ``metadata["help"]`` (the config reference in docs/configuration.md and
``dtrain config`` print it). Files are loaded by :mod:`dtrain.config.load` and validated once, at load time, by
:mod:`dtrain.config.checks`, with errors that name the file, the section and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.codec import CODEC_BITS, MASK_BITS, STORED, Bits, kept_per_chunk, sparse_scheme
from dtrain.config.field import setting as _f
from dtrain.config.ops import HealthConfig, SecurityConfig, TelemetryConfig

REPO_CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
ISLAND_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # what an island may be called (Join's name)
# An island's identity under security.identity "token" or "cert" (dtrain/net/identity.py makes them): its token's name
# in security.island_tokens, its client certificate's first URI SAN, or, with none, its certificate's CN.
IDENTITY_KINDS = ("token", "uri", "cn")


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the field."""


CODEC_NAMES = (*CODEC_BITS, "sparse", "mask")  # codec.up / codec.down: the dense codecs by their bits, sparse, mask
ATTENTION_KINDS = ("auto", "xla", "cudnn", "einsum")  # model.attention
REMAT_POLICIES = ("none", "full", "dots", "names")  # model.remat
REMAT_LEGACY = {True: "full", False: "none", "true": "full", "false": "none"}  # model.remat as a bool, as it was

@dataclass(frozen=True)
class RunConfig:
    name: str = _f("", "run name; outputs go to OUT_DIR/NAME (empty: the config file's stem)")
    out_dir: str = _f("runs", "folder that holds one subfolder per run")
    seed: int = _f(0, "seed for parameter init and data shuffling")
    log_every: int = _f(50, "inner steps between progress lines and train-loss events")
    eval_every: int = _f(0, "train: inner steps between evals (0: only at the end); simulate evaluates every round")
    checkpoint_every: int = _f(0, "train: inner steps between orbax checkpoints (0: only at the end)")
    keep_checkpoints: int = _f(2, "how many checkpoints to keep on disk")


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # model.family: the Hugging Face families of the llama
ROPE_SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")  # model.rope_scaling: transformers' rope_type


@dataclass(frozen=True)
class ModelConfig:
    kind: str = _f("gpt", "model family: gpt (a byte GPT: learned positions, LayerNorm, GELU MLP), llama (Hugging "
                   "Face's LlamaForCausalLM: RoPE, RMSNorm, SwiGLU, grouped-query attention) or mlp (a bigram MLP for "
                   "tests)",
                   choices=("gpt", "llama", "mlp"))
    vocab_size: int = _f(256, "vocabulary size (256 = raw bytes; a tokenizer's size for a token store, e.g. 128256 "
                         "for Llama 3's)")
    seq_len: int = _f(64, "tokens per training sequence (context length)")
    d_model: int = _f(64, "residual width")
    n_layers: int = _f(2, "transformer blocks (gpt) or hidden layers (mlp)")
    n_heads: int = _f(4, "attention heads; must divide d_model")
    mlp_ratio: int = _f(4, "gpt: MLP hidden width as a multiple of d_model (the llama ignores it: model.mlp_hidden)")
    dtype: str = _f("float32", "compute dtype; parameters are always kept in float32",
                    choices=("float32", "bfloat16"))
    attention: str = _f("auto", "gpt, llama: the attention kernel: auto (cudnn on an NVIDIA GPU where it applies: "
                        "bfloat16, head size a multiple of 8; else xla), jax.nn.dot_product_attention's xla or cudnn "
                        "(fused flash attention: NVIDIA GPUs, bfloat16, head size a multiple of 8) implementation, or "
                        "einsum (written out, a reference); how the model computes, not what: not in the fingerprint",
                        choices=ATTENTION_KINDS)
    remat: str = _f("none", "gpt, llama: what each block keeps for the backward pass: none (everything, no "
                    "recomputation), full (only its input: the rest recomputed, about a third more FLOPs), dots "
                    "(the matmul outputs without batch dimensions; the rest recomputed) or names (the attention's "
                    "q, k, v and output; the rest recomputed); true and false mean full and none; not in the "
                    "fingerprint", choices=REMAT_POLICIES)
    loss_chunk: int = _f(0, "gpt, llama, mlp: compute the loss over chunks of this many positions, so the "
                         "[batch, seq, vocab] float32 logits are never held whole (each chunk's logits are "
                         "recomputed in the backward pass); 0: off, the whole logits at once; the large-vocabulary "
                         "configs set it; not in the fingerprint")
    n_kv_heads: int = _f(0, "llama: key/value heads of grouped-query attention, dividing n_heads (0: n_heads, "
                         "multi-head attention); the other kinds reject a value other than the default")
    mlp_hidden: int = _f(0, "llama: SwiGLU hidden width (0: Llama's rule, int(8 * d_model / 3) rounded up to a "
                         "multiple of 256); the other kinds reject a value other than the default")
    rope_theta: float = _f(10000.0, "llama: rotary position embedding base (Llama 2: 10000, Llama 3: 500000; "
                           "model.rope_scaling scales it); the other kinds reject a value other than the default")
    norm_eps: float = _f(1e-5, "llama: RMSNorm epsilon; the other kinds reject a value other than the default")
    tie_embeddings: bool = _f(False, "llama: the head is the token table (logits = x @ embedding.T, no head "
                              "parameter); the other kinds reject a value other than the default")
    family: str = _f("llama", "llama: the Hugging Face family the model is (one implementation, a few switches): "
                     "llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM: q, k, v biases), qwen3 (Qwen3ForCausalLM: "
                     "q and k RMSNorm), mistral (MistralForCausalLM: model.sliding_window)",
                     choices=FAMILIES)
    head_dim: int = _f(0, "llama: attention head size (0: d_model / n_heads; Qwen 3 0.6B: 128 with d_model 1024 "
                       "and 16 heads)")
    attention_bias: bool = _f(False, "llama, qwen3: biases on the q, k, v and o projections (Hugging Face's "
                              "attention_bias; qwen2 always has q, k, v biases and no o bias, mistral none)")
    mlp_bias: bool = _f(False, "llama (family llama): biases on the SwiGLU's gate, up and down projections")
    sliding_window: int = _f(0, "llama (family mistral): each position attends to the last N positions, itself "
                             "included (0: all earlier positions)")
    max_positions: int = _f(0, "llama: the context length the model is made for, Hugging Face's "
                            "max_position_embeddings (0: seq_len); dynamic rope scaling reads it, export writes it")
    rope_scaling: str = _f("none", "llama: rope scaling, Hugging Face's rope_type: none, linear (positions / "
                           "rope_factor), dynamic (NTK, past max_positions), yarn, llama3 (Llama 3.1+)",
                           choices=ROPE_SCALINGS)
    rope_factor: float = _f(1.0, "llama: rope scaling's factor (Llama 3.2: 32; 1 without scaling)")
    rope_original_max: int = _f(0, "llama: rope scaling's original_max_position_embeddings, for llama3 and yarn "
                                "(0: max_positions; Llama 3.x: 8192)")
    rope_low_freq_factor: float = _f(1.0, "llama: llama3 rope scaling's low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama: llama3 rope scaling's high_freq_factor")
    init_from: str = _f("", "a Hugging Face model folder (safetensors weights) whose tensors are θ_0 instead of "
                        "run.seed's initialization: llama from LlamaForCausalLM, Qwen2ForCausalLM, "
                        "Qwen3ForCausalLM or MistralForCausalLM, gpt from GPT2LMHeadModel; the [model] fields its "
                        "config.json sets are taken from it when the folder is there as the config is loaded (one "
                        "given otherwise is refused), and every name and shape is checked where θ_0 is made (the "
                        "coordinator; dtrain train and simulate --inprocess; docs/models.md); islands receive θ_0 "
                        "from the coordinator: not in the fingerprint")

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the llama's grouped-query attention: ``n_kv_heads``, 0 meaning ``n_heads``."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """The attention head size: ``head_dim``, 0 meaning ``d_model // n_heads``."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def swiglu_hidden(self) -> int:
        """The llama's SwiGLU hidden width F: ``mlp_hidden``, or with 0 Llama's rule, ``int(2 * 4 * d_model / 3)``
        rounded up to a multiple of 256 (the published models give theirs explicitly: Llama 3 8B's 14336)."""
        return self.mlp_hidden or -(-int(2 * 4 * self.d_model / 3) // 256) * 256

    @property
    def positions(self) -> int:
        """The llama's max_position_embeddings: ``max_positions``, 0 meaning ``seq_len``."""
        return self.max_positions or self.seq_len


MIX_PERIOD = 1000  # data.sources: the mixture's schedule repeats every this many sequences (dtrain.data.mixture)
SOURCE_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # what a source of a mixture may be called


@dataclass(frozen=True)
class SourceConfig:
    """One token store of a mixture (``[[data.sources]]``)."""

    path: str = _f("", "the token store (a folder made by `dtrain tokenize`, or a file://, gs://, s3:// or http(s):// "
                   "URL)")
    weight: float = _f(1.0, "its share of the sequences, relative to the other sources' weights (normalised: 7, 2, 1 "
                       "is 0.7, 0.2, 0.1)")
    name: str = _f("", "what summaries and the dashboard call it (default: the store's last path component)")

    @property
    def label(self) -> str:
        """:attr:`name`, else the last component of :attr:`path`."""
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class DataConfig:
    source: str = _f("builtin", "a token store (a folder made by `dtrain tokenize`, or a file://, gs://, s3:// "
                     "or http(s):// URL), or 'builtin' (the interpreter's standard-library sources), a text file, "
                     "a folder of text files, a .jsonl(.gz/.zst) or .parquet file or folder or a datasets folder "
                     "(documents in field 'text'), or a .bin uint16 token shard / folder of shards: these become "
                     "a store under data.cache on first use, tokenized with data.tokenizer")
    max_bytes: int = _f(8_000_000, "use at most this many tokens of the source, from its start (0: all of it)")
    tokenizer: str = _f("bytes", "how a text source (builtin, text files) becomes a store: 'bytes' (one id per byte, "
                        "vocabulary 256), 'bpe:N' (a byte-level BPE of N ids trained on the source, written into "
                        "the store), or a tokenizer.json path; set model.vocab_size to cover it")
    cache: str = _f("", "where non-store sources become token stores (default: OUT_DIR/data-cache, shared by the "
                    "runs there); a store is reused while its source files are unchanged")
    eval_fraction: float = _f(0.05, "tail fraction of the corpus held out for eval loss")
    eval_batches: int = _f(8, "batches of the held-out split averaged for one eval")
    read_timeout_s: float = _f(60.0, "how long one read of the token store (its manifest, a block of ids) may wait "
                               "before the island stops with an error naming the store")
    sources: tuple[SourceConfig, ...] = _f((), "a mixture of token stores instead of data.source: [[data.sources]] "
                                           "tables of path, weight (relative) and name; every island's shard "
                                           "interleaves them by weight, the same sequence for the same config "
                                           "(docs/data.md)")
    document_masking: bool = _f(False, "keep documents apart inside a sequence: attention stops at each document's "
                                "first token and positions restart at 0 there, from the store's document ends "
                                "(Llama-style pretraining); off: windows cut across documents, as one text")

    @property
    def mixed(self) -> bool:
        """Whether the run reads a mixture (:attr:`sources`) rather than :attr:`source`."""
        return bool(self.sources)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = _f(16, "sequences per inner step per island (split over the island's devices)")
    steps: int = _f(400, "inner steps per island for the whole run (sets the lr schedule length)")
    optimizer: str = _f("adamw", "the inner optimizer: adamw, or muon (Muon on the hidden weight matrices, AdamW at "
                        "train.lr on the embedding tables, the output head, norms and biases)",
                        choices=("adamw", "muon"))
    lr: float = _f(4e-4, "peak inner AdamW learning rate")
    muon_lr: float = _f(0.02, "muon: peak learning rate of the orthogonalized matrix updates (scaled by "
                        "sqrt(max(1, fan_out / fan_in))), on the same warm-up + cosine schedule as train.lr")
    muon_beta: float = _f(0.95, "muon: the Nesterov momentum of the matrix updates, in [0, 1)")
    muon_weight_decay: float = _f(0.0, "muon: decoupled weight decay of the matrices (times muon_lr)")
    warmup_steps: int = _f(50, "linear lr warm-up steps")
    min_lr_ratio: float = _f(0.1, "cosine decay floor as a fraction of lr")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)")
    b1: float = _f(0.9, "AdamW beta1")
    b2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "global gradient-norm clip (0: off)")
    steps_per_call: int = _f(10, "inner steps fused into one jitted lax.scan (fewer host round trips)")
    base_batch_size: int = _f(0, "the batch size that train.steps, train.warmup_steps and outer.inner_steps count "
                              "steps of (0: train.batch_size): an island whose train.batch_size differs takes "
                              "steps x base_batch_size / batch_size inner steps for the same tokens (its shard, its "
                              "lr schedule, its step rounds); set it to the run's batch size when islands differ")

    @property
    def base_batch(self) -> int:
        """The batch size the run's step counts are in: ``base_batch_size``, else ``batch_size``."""
        return self.base_batch_size or self.batch_size

    @property
    def shard_sequences(self) -> int:
        """Sequences in each island's shard with step rounds: ``steps`` x :attr:`base_batch` (the same tokens
        whatever an island's own batch size)."""
        return self.steps * self.base_batch

    def island_steps(self, steps: int) -> int:
        """``steps`` of :attr:`base_batch` sequences as this island's steps of ``batch_size`` sequences (the
        same tokens; rounded down, at least 1 for a positive count)."""
        return max(steps * self.base_batch // self.batch_size, 1 if steps > 0 else 0)


@dataclass(frozen=True)
class OuterConfig:
    islands: int = _f(4, "number of islands (replicas) in simulate")
    inner_steps: int = _f(50, "H: inner steps per island between outer steps")
    lr: float = _f(0.7, "outer learning rate (DiLoCo: 0.7)")
    momentum: float = _f(0.9, "outer momentum (DiLoCo: 0.9)")
    nesterov: bool = _f(True, "Nesterov outer momentum")
    rule: str = _f("nesterov", "the outer update: nesterov (DiLoCo: SGD with outer.lr, outer.momentum, "
                   "outer.nesterov) or sparseloco (SparseLoCo: no outer momentum; theta -= outer.sparseloco_lr x "
                   "the mean of the pushes; each island's error feedback decays by outer.sparseloco_beta)",
                   choices=("nesterov", "sparseloco"))
    sparseloco_lr: float = _f(1.0, "sparseloco: outer learning rate applied to the mean of the sparse pushes")
    sparseloco_beta: float = _f(0.95, "sparseloco: decay of each island's error-feedback accumulator "
                                "(e <- beta x e + delta before the top-k), in (0, 1]")
    mask_lr: float = _f(2.5, "sparseloco with the mask codec (codec.up = mask): its outer learning rate, in place of "
                        "outer.sparseloco_lr (fitted in the default convergence protocol: docs/benchmarks.md)")
    mask_beta: float = _f(0.5, "sparseloco with the mask codec: its error-feedback decay, in place of "
                          "outer.sparseloco_beta (a value waits several rounds for its turn), in (0, 1]")
    staleness_alpha: float = _f(0.5, "a delta s versions stale is weighted by (1+s)^-alpha")
    fragments: int = _f(1, "Streaming DiLoCo: theta is cut into this many fragments of whole tensors, each pushed, "
                        "merged and versioned on its own; an island pushes one fragment every outer.inner_steps / "
                        "fragments steps, round robin (1: the whole theta every outer.inner_steps)")


@dataclass(frozen=True)
class MeshConfig:
    data: int = _f(-1, "devices on the 'data' axis (-1: all devices not used by fsdp)")
    fsdp: int = _f(1, "devices on the 'fsdp' axis: parameters and optimizer state are sharded over it")


@dataclass(frozen=True)
class CodecConfig:
    up: str = _f("int8", "codec for pushed pseudo-gradients (sparse: top codec.density of each chunk of "
                 "codec.sparse_chunk values, in codec.sparse_bits bits; mask: the codec.mask_density of the values "
                 "that the version's mask selects, in 2 bits)", choices=CODEC_NAMES)
    down: str = _f("int8", "codec for the broadcast outer update (fp32: lossless; sparse: the entries the merged "
                   "pushes touched, in codec.sparse_bits bits; mask: the entries of the version's mask, in 2 bits)",
                   choices=CODEC_NAMES)
    block: int = _f(1024, "values per quantization block (even, 64..65536)")
    zstd_level: int = _f(3, "zstd level for the coordinator's update frames (1..19)")
    up_zstd_level: int = _f(0, "zstd level for the islands' pushes (-7..-1, 1..19; 0: by codec.up, see push_level): "
                            "0 stores int8 pushes without zstd (their codes hardly compress: ~9% more bytes up than "
                            "at 3 on fabricated normal deltas, 0.3% on a trained one; the coordinator skips the "
                            "decompression, a push's largest cost at 64 islands); negative stores the codes raw, "
                            "decoded 5-8x faster than at 3, for more bytes up: int4 ~27%, e3m0 ~15%, sparse ~48%")
    chunk_bytes: int = _f(2 << 20, "bytes per streamed chunk (4 KiB..4 MiB); a push's chunks are checked, normed and "
                          "spooled one at a time, so fewer, larger chunks cost the coordinator less (2 MiB: a tenth "
                          "less CPU than 1 MiB at 64 islands); a pull's are at most half its island's stream share")
    error_feedback: bool = _f(True, "keep the quantization residual and add it to the next delta")
    sparse_chunk: int = _f(4096, "sparse codec: values per chunk (even, 64..32768); one scale per chunk")
    density: float = _f(0.02, "sparse codec: fraction of each chunk an island sends (top by magnitude), in (0, 1]; "
                        "the coordinator refuses a push that holds more")
    sparse_bits: int = _f(2, "sparse codec: bits per kept value (2, 4 or 8)", choices=(2, 4, 8))
    down_density: float = _f(0.0, "sparse update (codec.down = sparse): 0 sends every entry the merged pushes "
                             "touched (their union, up to islands x codec.density); > 0 sends the top down_density "
                             "of each chunk of the update plus the coordinator's residual, in [0, 1]; the rest waits "
                             "in the residual (codec.error_feedback)")
    mask_density: float = _f(0.2, "mask codec: fraction of the values sent each round, both ways, in (0, 1]: the "
                             "entries a mask seeded by the round's version selects (the same on every island and "
                             "the coordinator: no indices sent), 2 bits each, one scale per codec.sparse_chunk "
                             "values; each value goes once every ~1/mask_density rounds, error feedback keeps the "
                             "rest")

    def push_level(self) -> int:
        """The zstd level the islands push at: ``up_zstd_level``, or with 0 ``codec.STORED`` for int8 (no zstd: its
        codes hardly compress, and the coordinator hands a stored body on as it comes) and ``zstd_level`` for every
        other codec (whose codes zstd compresses by far more: int4 27%, e3m0 15%, sparse 48%)."""
        if self.up_zstd_level:
            return self.up_zstd_level
        return STORED if self.up == "int8" else self.zstd_level

    def scheme(self, name: str) -> tuple[Bits, int]:
        """The codec scheme and its block for the codec ``name`` (``up`` or ``down``'s value): a dense codec's
        bits and ``block``, or the sparse scheme of ``sparse_bits`` and ``sparse_chunk``."""
        if name == "sparse":
            return sparse_scheme(self.sparse_bits), self.sparse_chunk
        if name == "mask":
            return MASK_BITS, self.sparse_chunk
        return CODEC_BITS[name], self.block

    def density_of(self, name: str) -> float:
        """The density the codec ``name`` sends at: ``mask_density`` (mask), ``density`` (sparse; unused by the
        dense codecs)."""
        return self.mask_density if name == "mask" else self.density

    @property
    def max_count(self) -> int:
        """Entries a sparse push keeps per chunk (and the most the coordinator accepts)."""
        return kept_per_chunk(self.density, self.sparse_chunk)


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = _f("127.0.0.1", "address the coordinator binds (dtrain coordinator)")
    port: int = _f(50051, "port the coordinator binds (0: any free port)")
    dashboard_port: int = _f(8051, "port of the live dashboard (HTTP, or HTTPS with TLS; the coordinator's token, "
                             "on coordinator.dashboard_host): the page / and /api/status; 0: any free port, also "
                             "taken whenever the coordinator's own port is 0 (dtrain simulate); -1: no dashboard")
    dashboard_host: str = _f("", "address the dashboard binds; empty: coordinator.host. A coordinator that serves "
                             "gRPC on every interface (0.0.0.0) can keep its dashboard on loopback (127.0.0.1), "
                             "reached through an SSH tunnel or kubectl port-forward (deploy/ does)")
    mode: str = _f("sync", "sync: rounds with quorum; async: merge each delta on arrival", choices=("sync", "async"))
    min_quorum: int = _f(0, "sync: pushes that may close a round once grace_s has passed (0: every live island)")
    grace_s: float = _f(30.0, "sync: seconds after a round's first push before a quorum close is allowed")
    lease_s: float = _f(4.0, "an island that sends no heartbeat for this long is lost (4 s with 1 s heartbeats: "
                        "a dead island is found within 4 s, three late heartbeats are forgiven)")
    late_policy: str = _f("discount", "late deltas: apply to the open round with weight (1+s)^-alpha, or drop them "
                          "(always counted)", choices=("discount", "drop"))
    max_staleness: int = _f(4, "deltas more than this many versions old are dropped (counted)")
    keep_updates: int = _f(16, "past compressed updates kept so a lagging island catches up without a full pull")
    max_message_bytes: int = _f(8 << 20, "largest gRPC message accepted (chunks must fit)")
    checkpoint: bool = _f(True, "checkpoint the whole coordinator state with orbax after each merge")
    max_receiving: int = _f(16, "pushes whose frames stream in and are decoded at once; the others wait, their data "
                            "held back by gRPC's flow control (at most stream_window_bytes each): bounds the decoders' "
                            "memory (a few MiB a push) whatever the number of islands; 0: no limit")
    merge_threads: int = _f(0, "threads of the outer step: each reads and sums every pending push over its own "
                            "slabs of the model, then steps them (numpy and file I/O release the GIL); 0: half the "
                            "cores the coordinator may use, at least 1 (the sum is bound by memory: on 2 cores a "
                            "second thread cost a fifth more CPU and saved no time)")
    workers: int = _f(0, "threads doing the data plane's work (a push chunk's CRC, checks and spool write, a pull's "
                      "messages); 0: one per core the coordinator may use, at least 2. A waiting push stream or "
                      "long-polling pull holds none; a push's reply waiting for a merge holds one of a pool of its "
                      "own (3 per island + 8), and Joins, heartbeats and Status have threads of their own")
    stream_idle_s: float = _f(30.0, "a push stream that sends nothing for this long (its header, or its next "
                              "chunk) is cancelled, freeing the server thread it holds; time the coordinator itself "
                              "takes (decoding, max_receiving, a merge) does not count")
    max_streams_per_peer: int = _f(0, "push streams one peer host may hold open at once; more are refused "
                                   "(RESOURCE_EXHAUSTED, retried by workers); 0: outer.islands + 8 (every island of "
                                   "a run may share one host: dtrain simulate, a NAT)")
    max_streams_per_island: int = _f(2, "push streams one island (its headers' island_id) may hold receiving at "
                                     "once, counted from a stream's first chunk: a push and a retry of it; more are "
                                     "refused (RESOURCE_EXHAUSTED, retried by workers)")
    stream_min_bytes_per_s: float = _f(8192.0, "a push stream whose average rate since its header falls below this "
                                       "once it has waited stream_rate_grace_s on its client is cancelled, and a "
                                       "message resets the stream_idle_s clock only when the stream kept this rate "
                                       "since the last reset; only time waiting on the client counts. 8 KiB/s "
                                       "(64 kbit/s) sits far below a slow WAN link (20 Mbit/s: docs/benchmarks.md); "
                                       "0: off")
    stream_rate_grace_s: float = _f(10.0, "time a push stream may wait on its client after its header before "
                                    "stream_min_bytes_per_s applies (a slow start, a TCP retransmission)")
    stream_deadline_s: float = _f(1800.0, "a push stream still receiving this long after it opened is cancelled, "
                                  "whatever its rate: set it above what the largest push takes on the slowest link "
                                  "(a 1 GB frame at 20 Mbit/s: 400 s)")
    max_pulls_per_peer: int = _f(0, "PullGlobal calls one peer host may hold at once, long polls included; more are "
                                 "refused (RESOURCE_EXHAUSTED, retried by workers); 0: outer.islands + 8")
    max_pulls_per_island: int = _f(3, "PullGlobal calls one island may hold at once, long polls included: its "
                                   "exchange's long poll, its training loop's pull and a retry; more are refused "
                                   "(RESOURCE_EXHAUSTED, retried by workers), so a flood of parked pulls holds this "
                                   "many data threads at most")
    stream_window_bytes: int = _f(4 << 20, "receive window per incoming stream at most, fixed: bounds the memory "
                                  "pushes in flight hold (islands x window); over a WAN set it >= per-island "
                                  "bandwidth x RTT; 0: gRPC's auto-tuning (BDP probing), unbounded")
    stream_budget_bytes: int = _f(64 << 20, "what all islands' frame streams may hold in the coordinator at once, "
                                  "each way: an island's share is this / outer.islands (at least 64 KiB, at most "
                                  "stream_window_bytes); an incoming stream's receive window is its share, an "
                                  "outgoing pull's chunks half of it (at most codec.chunk_bytes): memory stays "
                                  "flat however many islands there are. Set it >= the coordinator's link "
                                  "bandwidth x RTT; 0: stream_window_bytes windows, codec.chunk_bytes chunks")
    pull_cache_bytes: int = _f(64 << 20, "the chunk messages of the frames pulls serve, kept in memory so each "
                               "frame is read, CRC'd and chunked once, not once per island pulling it; the least "
                               "recently pulled go first, a larger frame streams from disk; 0: none")
    max_push_steps: int = _f(0, "most inner steps one push may cover: its tokens must be <= its cursor range x "
                             "model.seq_len, the range <= this x train.batch_size sequences (0: outer.inner_steps "
                             "/ outer.fragments with step rounds; no cap with wall-time rounds, where it is worth "
                             "setting)")
    merge_rule: str = _f("auto", "how the pushes of a round are combined, per coordinate: the token-weighted mean, "
                         "a trimmed mean or the median (both unweighted), the token-weighted mean of the pushes "
                         "each clipped to clip_ratio x the median L2 norm of the round's pushes, or screened_mean: "
                         "the token-weighted mean of the pushes whose direction agrees with the round's (cosine "
                         ">= min_cosine with the coordinate median of the round's pushes; the others are rejected) "
                         "(docs/faults.md has the measured cost of each); auto: screened_mean, or clipped_mean with "
                         "a sparse codec.up (a per-coordinate median or trim of sparse pushes drops the entries "
                         "only one push holds) or coordinator.shards > 1 (no direction screen there yet)",
                         choices=("auto", "mean", "trimmed_mean", "median", "clipped_mean", "screened_mean"))
    trim: int = _f(1, "trimmed_mean: values dropped at each end of every coordinate (at most (pushes-1)//2)")
    clip_ratio: float = _f(1.0, "clipped_mean: a push's L2 norm is clipped to this multiple of the median norm of "
                           "the round's pushes")
    min_cosine: float = _f(0.0, "screened_mean: when a round of 3 or more pushes closes, a push whose cosine with "
                           "the coordinate median of the round's pushes is below this is rejected (quarantined): "
                           "honest deltas point the same way, a reversed one away; in [-1, 1)")
    probation_min_cosine: float = _f(-0.15, "screened_mean, a run of fewer than 3 islands: a push from an island "
                                     "whose last push was rejected is rejected if its cosine with the outer "
                                     "momentum is below this (honest deltas late in a run are all but orthogonal "
                                     "to it, -0.08 to 0.12 measured); with 3 islands or more, such a push in a "
                                     "round of fewer than 3 pushes is rejected whatever its cosine; in [-1, 1)")
    round_norm_ratio: float = _f(4.0, "when a round closes, a push whose L2 norm exceeds this multiple of the median "
                                 "norm of the round's pushes is rejected (quarantined), from the first round on "
                                 "(rounds of 3 or more pushes); 0: off")
    norm_z_max: float = _f(8.0, "a push whose L2 norm is more than this many robust deviations above the median of "
                           "the recent accepted norms is rejected (quarantined); in a sync round of 3 pushes or "
                           "more, judged when the round closes with the round's own norms beside them (honest "
                           "norms growing together move the median); 0: off")
    norm_max_ratio: float = _f(10.0, "a push whose L2 norm exceeds this multiple of the L2 norm of θ is rejected "
                               "(quarantined), from the first round on (while θ is not 0); 0: off")
    norm_window: int = _f(8, "how many recent accepted push norms the outlier check compares against (a short "
                          "window follows the honest norms as they shrink)")
    norm_window_min: int = _f(4, "the outlier check applies once the window holds this many norms")
    clip_norm: float = _f(0.0, "> 0: a push whose L2 norm exceeds this is scaled down to it (through its merge "
                          "weight); 0: off")
    max_rejections: int = _f(3, "an island whose pushes are rejected this many times in a row is itself quarantined: "
                             "told to stop (in the answer to its push, and its heartbeats), its pushes and Joins "
                             "refused, its shard rerouted to the others; 0: never")
    reject_backoff_s: float = _f(1.0, "after a rejected push, the island's next push is refused (before its payload "
                                 "streams in) for this many seconds, doubled with each rejection in a row; 0: off")
    eval_every: int = _f(5, "evaluate the global θ on the held-out split every this many versions (θ_0 and the "
                         "final version too): an island that pulls such a version evaluates it and reports it "
                         "in a heartbeat (an `eval` event), the evals spread over the live islands (an eval is "
                         "time an island does not train); 0: only the final version")
    refusal_events: int = _f(20, "refused calls (Joins, heartbeats, pushes, pulls; a wrong token has its own limit): "
                             "the first this many of a kind (method and status code) each minute are each an event "
                             "and a progress line, the rest one `refusals_suppressed` event with their count; all "
                             "are counted in Status' refusals")
    forget_after_s: float = _f(3600.0, "a lost island's record is dropped from the coordinator's state (Status, "
                               "/api/status, its checkpoint) this long after its lease ended, unless a push of "
                               "its is pending; its events stay, and under its name it can still join again (a new "
                               "record; shards and data cursors are unaffected); 0: never")
    shards: int = _f(1, "coordinator shards S: theta is cut into S contiguous ranges of whole tensors (the plan of "
                     "outer.fragments), each merged by its own coordinator process (dtrain coordinator --shard I "
                     "--shards S); shard 0, the lead, also holds membership, leases, cursors and the rounds "
                     "(docs/architecture.md#shards); 1: one coordinator")
    shard_addresses: tuple[str, ...] = _f((), "shards > 1: HOST:PORT of coordinator shards 1..S-1, in order, as the "
                                          "lead and the islands reach them (the lead tells the islands at Join)")
    shard_secret_file: str = _f("", "shards > 1: file holding the secret the lead presents to the other shards "
                                "(their Shard service refuses any call without it); every shard reads the same file")

    @property
    def dashboard_address(self) -> str:
        """The address the dashboard binds: ``dashboard_host``, else ``host``."""
        return self.dashboard_host or self.host


@dataclass(frozen=True)
class WorkerConfig:
    overlap: bool = _f(True, "keep training while a push/pull is in flight; fold the new θ in on arrival")
    max_overlap_steps: int = _f(5, "with overlap: inner steps an island may take past a push before it waits "
                                "for the new θ (Streaming DiLoCo: tau <= 5; larger trades quality for idle time); "
                                "with round_seconds = auto, every island may train on past a push for this share "
                                "of outer.inner_steps of the round (and at least this many of its own steps)")
    round_seconds: float = _f(0.0, "> 0: a round is this many seconds of training (H differs per island); "
                              "0: outer.inner_steps steps; 'auto' (-1): wall-time rounds in which the islands together "
                              "train the tokens of outer.inner_steps steps of train.base_batch_size sequences per "
                              "island (so train.steps / outer.inner_steps rounds train the run's tokens), from the "
                              "islands' token rates measured in round 1's training (round 1 lasts until every "
                              "island has one; an island that joins later takes the run's length); in sync mode "
                              "the coordinator then paces each later round so the run merges that many tokens")
    start_wait_s: float = _f(60.0, "before the first step, wait up to this long for outer.islands islands to "
                             "have joined, so round 1 starts together (0: start at once)")
    heartbeat_s: float = _f(1.0, "seconds between heartbeats (at most half of coordinator.lease_s)")
    rpc_deadline_s: float = _f(60.0, "deadline of one RPC")
    retry_initial_s: float = _f(0.2, "first retry backoff on UNAVAILABLE (and DEADLINE_EXCEEDED, a busy "
                                "coordinator's RESOURCE_EXHAUSTED)")
    retry_max_s: float = _f(5.0, "backoff ceiling")
    retry_total_s: float = _f(600.0, "give up after retrying this long (a coordinator outage longer than this)")
    compile_cache: str = _f("", "folder of JAX's persistent compilation cache: a start of the island (a restart "
                            "above all) loads the programs an earlier start compiled instead of compiling them "
                            "again; '': compile-cache in the island's folder (`dtrain worker --run-dir`; `dtrain "
                            "simulate` gives its islands RUN_DIR/compile-cache, which they share); 'off': none, "
                            "every start compiles")


ROUND_AUTO = -1.0  # worker.round_seconds = "auto", as stored

# Settings an island may have of its own (`dtrain worker --set`, `dtrain simulate --island NAME:...`): how it
# computes, not what; never a fingerprint field (Config.fingerprint_fields), which every island must share.
PER_ISLAND_FIELDS = ("train.batch_size", "train.steps_per_call", "model.attention", "model.remat",
                     "model.loss_chunk",
                     "worker.round_seconds", "outer.inner_steps", "worker.overlap", "worker.max_overlap_steps",
                     "mesh.data", "mesh.fsdp", "health.enabled")


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    @property
    def rounds(self) -> int:
        """Outer rounds per island: ceil(train.steps / outer.inner_steps) (one round when H = steps); with
        outer.fragments F, a round (one fragment's push and merge) every H / F steps: ceil(train.steps / (H / F))."""
        return math.ceil(self.train.steps / (self.outer.inner_steps // self.outer.fragments))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as plain TOML/JSON types (a tuple field, such as security.bindings, as a list)."""
        return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
                for name, section in dataclasses.asdict(self).items()}

    def fingerprint_fields(self, corpus: str = "") -> dict[str, str]:
        """What must match between the coordinator and every island: ``corpus``, the digest of the data the islands
        train on (:attr:`dtrain.data.corpus.Corpus.digest`, as ``data.corpus``; '' unknown: left out), model
        shapes, dtype, codecs (with a sparse codec
        or the sparseloco rule, also the sparse codec's fields and the rule with its β; not the model's
        compute knobs, :data:`COMPUTE_ONLY_MODEL_FIELDS`: a GPU island with cuDNN attention and a TPU island without
        train the same model; nor where θ_0 comes from, :data:`THETA0_ONLY_MODEL_FIELDS`; nor, for another kind, the
        llama-only fields, held at their defaults: a GPT's fingerprint is what it was before the llama came)."""
        skip = COMPUTE_ONLY_MODEL_FIELDS + THETA0_ONLY_MODEL_FIELDS + \
            (LLAMA_ONLY_MODEL_FIELDS if self.model.kind != "llama" else ())
        defaults = ModelConfig()
        fields = {f"model.{k}": str(v) for k, v in dataclasses.asdict(self.model).items() if k not in skip
                  and not (k in FAMILY_MODEL_FIELDS and v == getattr(defaults, k))}
        fields.update({f"codec.{k}": str(getattr(self.codec, k)) for k in ("up", "down", "block")})
        if "mask" in (self.codec.up, self.codec.down):  # only then: other runs' fingerprints stay as they were
            fields.update({f"codec.{k}": str(getattr(self.codec, k)) for k in ("sparse_chunk", "mask_density")})
            fields["outer.mask_beta"] = str(self.outer.mask_beta)
        if "sparse" in (self.codec.up, self.codec.down) or self.outer.rule != "nesterov":
            # only then: every other run's fingerprint stays what it was before the sparse codec came
            fields.update({f"codec.{k}": str(getattr(self.codec, k)) for k in ("sparse_chunk", "sparse_bits",
                                                                              "density")})
            fields.update({f"outer.{k}": str(getattr(self.outer, k)) for k in ("rule", "sparseloco_beta")})
        if self.outer.fragments != 1:  # only then: the fingerprint of a run without fragments stays as it was
            fields["outer.fragments"] = str(self.outer.fragments)
        if self.coordinator.shards != 1:  # the islands cut their pushes and pulls by the same plan
            fields["coordinator.shards"] = str(self.coordinator.shards)
        if self.data.document_masking:  # only then: islands that mask and islands that do not train other models
            fields["data.document_masking"] = "True"
        if corpus:  # every island's shard is cut from the same ids
            fields[CORPUS_FIELD] = corpus
        return fields

    def fingerprint(self, corpus: str = "") -> str:
        """Hash of :meth:`fingerprint_fields`."""
        blob = json.dumps(self.fingerprint_fields(corpus), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


CORPUS_FIELD = "data.corpus"  # the fingerprint field of the corpus' digest (Config.fingerprint_fields)
MAX_FRAGMENTS = 64  # outer.fragments at most (dtrain.train.fragments: each fragment holds one tensor at least)
# [model] fields that change how, not what, the model computes
COMPUTE_ONLY_MODEL_FIELDS = ("attention", "remat", "loss_chunk")
# [model] fields read only where θ_0 is made (the coordinator); islands receive θ_0 in their first full pull
THETA0_ONLY_MODEL_FIELDS = ("init_from",)
LLAMA_ONLY_MODEL_FIELDS = ("n_kv_heads", "mlp_hidden", "rope_theta", "norm_eps", "tie_embeddings")
# The llama's family switches: llama-only too, and in the fingerprint only when not at their defaults (a Llama's
# fingerprint is what it was before the families came)
FAMILY_MODEL_FIELDS = ("family", "head_dim", "attention_bias", "mlp_bias", "sliding_window", "max_positions",
                       "rope_scaling", "rope_factor", "rope_original_max", "rope_low_freq_factor",
                       "rope_high_freq_factor")
MAX_VOCAB_SIZE = 1 << 31  # ids reach the model as int32 (token stores hold uint16 or uint32 ids)

SECTIONS: dict[str, type] = {"run": RunConfig, "model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "outer": OuterConfig, "mesh": MeshConfig, "codec": CodecConfig, "coordinator": CoordinatorConfig,
            "worker": WorkerConfig, "health": HealthConfig, "security": SecurityConfig,
            "telemetry": TelemetryConfig}


COMPILE_CACHE_OFF = "off"  # worker.compile_cache: no persistent compilation cache


